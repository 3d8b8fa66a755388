"""The app-facing edge, served by the ASGI app itself rather than Django's request cycle: the
OpenAI- and Anthropic-compatible endpoints (`/v1/`) and the job API's long-lived requests
(`/api/jobs/{id}/wait/`, `/api/jobs/{id}/stream/`).

These requests spend almost all their time waiting for a job. Django's async views run every
request in its own thread-sensitive context (a thread and a database connection per request, kept
for the whole wait), so these paths are routed in telemachus/asgi.py before Django: a waiting
request holds neither; its database calls run on a few shared threads (scheduler/connections.py),
and one job feed per process tells every waiting request of the jobs it watches
(scheduler/notify/feed.py).

  router.py    the router in front of Django: each path to its dialect or to the job waits
  asgi.py      the request and response primitives every handler uses
  auth.py      who is calling: API tokens (Bearer or Token), the session cookie
  caller.py    a model call's caller and team, the `openai` switch, the caller's rate
  dialect.py   what a protocol is (Dialect, StreamWriter) and what all three share (ModelCall,
               the body's checks, errors in the protocol's shape, SSE)
  errors.py    GatewayError and the errors every protocol shares
  calls.py     one governed model call, whatever the protocol: submit, wait, relay, cancel
  relay.py     what a request relays of a job's output deltas, in order and once
  onehop.py    the calls this process claims and runs itself when they can run now (one hop),
               on the worker's flight host (scheduler/worker/host.py)
  openai/      POST /v1/chat/completions, POST /v1/embeddings, GET /v1/models: request.py checks
               the request, answer.py shapes the answer and its stream
  responses/   POST /v1/responses (OpenAI's Responses API over chat completions), likewise
  anthropic/   POST /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API), likewise
  jobwatch.py  GET /api/jobs/{id}/wait/ and /stream/
  schema.py    these paths in the OpenAPI schema
"""
