"""What .ci/schemathesis does not send: a number that is not finite. For every POST, PUT and PATCH
operation of the OpenAPI schema (the gateway's included), `1e999` at every field the operation's
body declares (and as an extra key of every object), sent to the API server as an operator: no answer is
a server error. (`1e999` is valid JSON that Python reads as infinity, which PostgreSQL refuses.)"""

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from drf_spectacular.generators import SchemaGenerator

from executors.routes import route_create
from quotas.models import QuotaPolicy
from tests.processes import Processes
from tests.scheduler.gateway.conftest import may_chat, token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

INFINITY = "__infinity__"
METHODS = ("post", "put", "patch")
CHAT_JOB = {
    "type": "chat",
    "team": "a",
    "priority": 0,
    "requirements": {"model": "m", "est_tokens": 10},
    "input": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
    "meta": {"note": "x"},
}
RULE = {"scope": "user", "subject": "alice", "dimension": "ai.tokens", "limit": 10, "window": "hour"}
# Valid bodies, so that a number in a free-form part (meta, input, capabilities, logit_bias...)
# gets as far as being stored; the schema adds every field it declares around them.
VALID = {
    ("post", "/api/executors/"): {
        "name": "fz",
        "kind": "sim",
        "team": None,
        "endpoint": None,
        "capabilities": {"models": ["m"], "memory_mb": 1},
        "max_concurrency": 1,
        "weight": 1,
        "enabled": True,
        "transport": {"timeout": 1},
        "meta": {"latency_ms": 1},
    },
    ("patch", "/api/executors/{executor_id}/"): {
        "name": "shared",
        "kind": "sim",
        "team": None,
        "endpoint": None,
        "capabilities": {"models": ["m"]},
        "meta": {},
        "transport": {},
    },
    ("put", "/api/features/"): {"feature": "chat", "team": "a", "enabled": True},
    ("post", "/api/jobs/"): CHAT_JOB,
    ("post", "/api/jobs/bulk/"): {"jobs": [CHAT_JOB]},
    ("put", "/api/policy/"): {"team_weights": {"a": 1}, "max_queue_depth": {"default": 100}, "priority_map": {}},
    ("post", "/api/quota-policies/"): RULE,
    ("put", "/api/quota-policies/{policy_id}/"): RULE,
    ("patch", "/api/quota-policies/{policy_id}/"): {"limit": 10},
    ("post", "/api/teams/"): {"slug": "fz", "name": "F", "members": [{"username": "alice"}], "grants": ["chat:use"]},
    ("patch", "/api/teams/{slug}/"): {"name": "A"},
    ("put", "/api/teams/{slug}/grants/"): {"team": ["chat:use"], "users": {"alice": ["chat:use"]}},
    ("post", "/api/teams/{slug}/members/"): {"username": "bob", "role": "member"},
    ("post", "/api/users/"): {"username": "fz", "email": "fz@example.com"},
    ("post", "/api/webhooks/"): {"team": "a", "url": "http://127.0.0.1:9/hook", "events": ["job.failed"]},
    ("patch", "/api/webhooks/{webhook_id}/"): {"enabled": False},
}
# The gateway's bodies are declared as plain objects: these are the fields OpenAI's shapes define.
GATEWAY_BODIES = {
    "/v1/chat/completions": {
        "model": "m",
        "messages": [{"role": "user", "content": "hi", "name": "n"}],
        "max_tokens": 16,
        "temperature": 0.5,
        "top_p": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "seed": 1,
        "logit_bias": {"50256": 1},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "response_format": {"type": "json_object"},
    },
    "/v1/embeddings": {"model": "m", "input": ["x"], "dimensions": 8, "encoding_format": "float"},
}


@pytest.fixture(scope="module")
def base(django_db_setup, django_db_blocker, tmp_path_factory):
    """The API server with the throttles off (as .ci/schemathesis runs it): each field is one request."""
    processes = Processes(tmp_path_factory.mktemp("schema"))
    try:
        with django_db_blocker.unblock():
            # A /v1/ call that got queued (nothing runs it here) answers 504 soon, not in minutes.
            yield processes.api_server(TELEMACHUS_SUBMIT_RATE="", TELEMACHUS_GATEWAY_TIMEOUT_SECONDS="3")
    finally:
        processes.stop_all()


def resolve(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[-1]]
    for combined in ("allOf", "oneOf", "anyOf"):
        if combined in schema:
            return resolve(schema[combined][0], components)
    return schema


def example(schema: dict[str, Any], components: dict[str, Any]) -> Any:
    """A body of the schema's shape: every property present, each value of its type."""
    schema = resolve(schema, components)
    if "enum" in schema:
        return next((v for v in schema["enum"] if v is not None), None)
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        return {name: example(sub, components) for name, sub in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [example(schema.get("items") or {}, components)]
    return {"integer": 1, "number": 1.5, "boolean": True}.get(kind, "x")  # type: ignore[arg-type]


def merged(declared: Any, valid: Any) -> Any:
    """The valid body, with every field the schema declares that it leaves out."""
    if isinstance(declared, dict) and isinstance(valid, dict):
        return {**declared, **{k: merged(declared.get(k), v) for k, v in valid.items()}}
    if isinstance(declared, list) and isinstance(valid, list) and declared and valid:
        return [merged(declared[0], valid[0]), *valid[1:]]
    return valid


def bodies(body: Any, at: tuple = ()) -> Iterator[tuple[str, Any]]:
    """Copies of the body with one field (or one extra key of an object) set to INFINITY."""
    if isinstance(body, dict):
        yield ".".join(map(str, (*at, "extra"))), {**body, "extra": INFINITY}
        for key, value in body.items():
            yield ".".join(map(str, (*at, key))), {**body, key: INFINITY}
            for path, inner in bodies(value, (*at, key)):
                yield path, {**body, key: inner}
    elif isinstance(body, list) and body:
        for path, inner in bodies(body[0], (*at, 0)):
            yield path, [inner, *body[1:]]


def operations(ids: dict[str, str]) -> Iterator[tuple[str, str, Any]]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    components = schema["components"]["schemas"]
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            if method not in METHODS:
                continue
            declared = ((op.get("requestBody") or {}).get("content") or {}).get("application/json")
            if declared is None:
                continue
            body = GATEWAY_BODIES.get(path) or merged(
                example(declared["schema"], components), VALID.get((method, path), {})
            )
            yield method, path.format(**ids), body


def test_a_non_finite_number_anywhere_is_never_a_server_error(base, member_setup, operator):
    alice, _, _, _, executor = member_setup
    policy = QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=100, window="day")
    route = route_create(name="smart", models=["m"])
    ids = {
        "executor_id": executor.pk,
        "policy_id": policy.pk,
        "slug": "a",
        "job_id": 1,
        "webhook_id": 1,
        "route_id": route.pk,
    }
    headers = {"Content-Type": "application/json", "Authorization": f"Token {token(operator)}"}
    gateway = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {token(may_chat(alice))}",
        "X-Telemachus-Team": "a",
    }
    sent, failures, operations_seen = 0, [], set()
    with httpx.Client(base_url=base, timeout=30) as client:
        for method, path, body in operations(ids):
            operations_seen.add((method, path))
            for field, crafted in bodies(body):
                raw = json.dumps(crafted).replace(f'"{INFINITY}"', "1e999")
                response = client.request(
                    method, path, content=raw, headers=gateway if path.startswith("/v1/") else headers
                )
                sent += 1
                if response.status_code >= 500:
                    failures.append((method.upper(), path, field, response.status_code, response.text[:200]))
    assert len(operations_seen) >= 15 and sent >= 150, (operations_seen, sent)
    assert failures == [], "\n".join(map(str, failures))
