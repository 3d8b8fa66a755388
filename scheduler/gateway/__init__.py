"""The app-facing edge, served by the ASGI app itself rather than Django's request cycle: the
OpenAI- and Anthropic-compatible endpoints (`/v1/`) and the job API's long-lived requests (`/api/jobs/{id}/wait/`,
`/api/jobs/{id}/stream/`).

These requests spend almost all their time waiting for a job. Django's async views run every
request in its own thread-sensitive context (a thread and a database connection per request, kept
for the whole wait), so these paths are routed in telemachus/asgi.py before Django: a waiting
request holds neither; its database calls run on a few shared threads (`database.py`), and one
listener per process tells every waiting request of the jobs it watches (`feed.py`).

  asgi.py      the router in front of Django, request and response primitives
  auth.py      who is calling: API tokens (Bearer or Token), the session cookie
  database.py  the shared database threads
  feed.py      one per process: job changes (PostgreSQL NOTIFY or SQLite's data_version) and
               output deltas (Redis, NOTIFY, or in process)
  calls.py     one governed model call, whatever the protocol: submit, wait, relay, cancel
  onehop.py    the calls this process claims and runs itself when they can run now (one hop)
  openai.py    POST /v1/chat/completions, POST /v1/embeddings, GET /v1/models
  responses/   POST /v1/responses (OpenAI's Responses API over chat completions): request.py
               translates the request, answer.py the answer and its stream
  anthropic/   POST /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API), likewise
  shapes.py    OpenAI's request checks, response bodies and error shape
  jobs.py      GET /api/jobs/{id}/wait/ and /stream/
  schema.py    these paths in the OpenAPI schema
"""
