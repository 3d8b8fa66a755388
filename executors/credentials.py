"""An executor's credentials for its server: write-only.

Where they go, in `transport` (any kind; the OpenAI-compatible drivers send them):

  api_key      the server's API key, sent as `Authorization: Bearer <key>`
  api_key_env  "NAME": the same, read from the environment variable NAME (the older spelling of
               "api_key": {"env": "NAME"})
  headers      {"<header>": <secret>}: any other header the server wants (Azure's `api-key`, a
               Basic credential in `Authorization`...), sent with every request
  secrets      {"<name>": <secret>}: a custom driver's own (`transport_secret`); the built-in
               drivers send none of them

A <secret> is given as the value itself, stored sealed (executors/sealing.py), or as
{"env": "NAME"}, read from the environment of the process that makes the request each time its
driver is built (nothing stored). Stored: {"sealed": "<Fernet token>"} or {"env": "NAME"}.
Shown by the API, the admin and the audit log (`transport_shown`): "******** (1a2b3c4d)" for a
sealed secret (a keyed digest's first eight hex digits, which change when the secret does),
{"env": "NAME"} as it is. A shown mask sent back (a transport read, edited and written again)
keeps the secret stored at that place.

Elsewhere in `transport` or `meta`, a name that reads as a secret's (`is_secret_name`), and
credentials in the endpoint URL, are refused with where they go instead: they would be stored in
clear and shown to whoever may read the executor."""

import copy
import json
import os
import re
from base64 import b64encode
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from executors.sealing import SecretUnreadable, secret_fingerprint, secret_reseal, secret_seal, secret_unseal
from telemachus.control.audit import MASK, is_secret_name

SEALED, ENV = "sealed", "env"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}")
# Headers the driver or the HTTP client own: a transport may not set them.
RESERVED_HEADERS = {
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "proxy-connection",
    "x-telemachus-job",
}
MAX_ENTRIES, MAX_SECRET_CHARS = 50, 8192
WHERE = (
    'put the key in transport.api_key (sent as "Authorization: Bearer <key>"), or the header the server '
    'wants in transport.headers, each as the secret itself or as {"env": "VARIABLE"}; stored sealed, never shown'
)


class SecretUnavailable(Exception):
    """A credential this process cannot produce: its environment variable is not set here, or no
    configured key unseals it."""


# --- what may be written --------------------------------------------------------------------------


def endpoint_problem(endpoint: str | None) -> str | None:
    """Why an endpoint URL may not be stored (it carries credentials), or None."""
    if not endpoint:
        return None
    try:
        parts = urlsplit(endpoint)
        userinfo = parts.username is not None or parts.password is not None
    except ValueError:
        return None  # the URL field's own check refuses it
    if userinfo or any(is_secret_name(name) for name, _ in parse_qsl(parts.query, keep_blank_values=True)):
        return (
            "Credentials do not go in the endpoint URL (it is shown to operators and written to logs): "
            f"{WHERE}. For a user and password, send transport.headers "
            '{"Authorization": "Basic <base64 of user:password>"}.'
        )
    return None


def secret_named(value: Any, path: str) -> list[str]:
    """The paths under `value` (named `path`) whose names read as a secret's, at any depth."""
    if isinstance(value, dict):
        found = []
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            found += [inner] if is_secret_name(str(key)) else secret_named(item, inner)
        return found
    if isinstance(value, list):
        return [found for index, item in enumerate(value) for found in secret_named(item, f"{path}[{index}]")]
    return []


def meta_problems(meta: dict[str, Any]) -> dict[str, str]:
    """`meta` holds no secret: each name there that reads as one, with where it goes."""
    return {path: f"looks like a secret: {WHERE}." for path in secret_named(meta, "")}


def _stored_at(stored: dict[str, Any] | None, place: str, name: str | None = None) -> dict[str, str] | None:
    """The sealed secret stored at transport.<place>[.<name>], if one is."""
    value = stored.get(place) if isinstance(stored, dict) else None
    if name is not None:
        value = value.get(name) if isinstance(value, dict) else None
    return value if isinstance(value, dict) and isinstance(value.get(SEALED), str) else None


def _secret_problem(value: Any, *, kept: dict[str, str] | None) -> str | None:
    if isinstance(value, str):
        if value.startswith(MASK):
            return None if kept is not None else "nothing is stored here to keep: send the secret itself."
        if not value or len(value) > MAX_SECRET_CHARS or any(c in value for c in "\r\n\0"):
            return f"must be the secret on one line, at most {MAX_SECRET_CHARS} characters."
        return None
    if (
        isinstance(value, dict)
        and set(value) == {ENV}
        and isinstance(value[ENV], str)
        and ENV_NAME.fullmatch(value[ENV])
    ):
        return None
    return 'must be the secret (a string) or {"env": "VARIABLE"}, the environment variable that holds it.'


def transport_credential_problems(transport: dict[str, Any], *, stored: dict[str, Any] | None) -> dict[str, str]:
    """What is wrong with the credentials of a transport to be written over `stored` (None for a
    new executor), per path under `transport`: a malformed secret, a mask with nothing stored at its
    place, a reserved or malformed header, a secret anywhere else."""
    problems: dict[str, str] = {}
    for place, value in transport.items():
        if place == "api_key":
            if problem := _secret_problem(value, kept=_stored_at(stored, place)):
                problems[place] = problem
        elif place == "api_key_env":
            if not (isinstance(value, str) and ENV_NAME.fullmatch(value)):
                problems[place] = "must be an environment variable name, like OPENAI_API_KEY."
        elif place in ("headers", "secrets"):
            if not isinstance(value, dict) or len(value) > MAX_ENTRIES:
                problems[place] = f"must be an object of at most {MAX_ENTRIES} names."
                continue
            for name, item in value.items():
                if place == "headers" and (not HEADER_NAME.fullmatch(name) or name.lower() in RESERVED_HEADERS):
                    problems[f"{place}.{name}"] = "is not a header name a transport may set."
                elif place == "secrets" and not 0 < len(name) <= 100:
                    problems[f"{place}.{name}"] = "a name of 1 to 100 characters."
                elif problem := _secret_problem(item, kept=_stored_at(stored, place, name)):
                    problems[f"{place}.{name}"] = problem
        else:
            for path in [place] if is_secret_name(place) else secret_named(value, place):
                problems[path] = f"looks like a secret: {WHERE}."
    headers = transport.get("headers")
    headers = headers if isinstance(headers, dict) else {}
    if "api_key" in transport and "api_key_env" in transport:
        problems["api_key"] = "give api_key or api_key_env, not both."
    if ("api_key" in transport or "api_key_env" in transport) and any(
        str(h).lower() == "authorization" for h in headers
    ):
        problems["headers.Authorization"] = "the API key is sent as Authorization already: give one or the other."
    return problems


def transport_has_credentials(transport: dict[str, Any]) -> bool:
    """Whether requests made with this transport carry a credential."""
    return bool(transport.get("api_key") or transport.get("api_key_env") or transport.get("headers"))


# --- stored, shown --------------------------------------------------------------------------------


def _sealed(value: Any, *, kept: dict[str, str] | None) -> dict[str, str]:
    if isinstance(value, str) and value.startswith(MASK):
        if kept is None:
            raise ValueError("a mask with no secret stored at its place (check transport_credential_problems first)")
        return dict(kept)
    if isinstance(value, str):
        return {SEALED: secret_seal(value)}
    return dict(value)  # {"env": NAME}, or already stored ({"sealed": ...})


def _places(transport: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
    if "api_key" in transport:
        yield "api_key", None
    for place in ("headers", "secrets"):
        if isinstance(transport.get(place), dict):
            yield from ((place, name) for name in transport[place])


def _replaced(transport: dict[str, Any], change: Any) -> dict[str, Any]:
    """The transport with `change(value, place, name)` applied to each secret."""
    out = {**transport, **{p: dict(transport[p]) for p in ("headers", "secrets") if isinstance(transport.get(p), dict)}}
    for place, name in _places(transport):
        if name is None:
            out[place] = change(transport[place], place, None)
        else:
            out[place][name] = change(transport[place][name], place, name)
    return out


def transport_sealed(transport: dict[str, Any], *, stored: dict[str, Any] | None) -> dict[str, Any]:
    """The transport as it is stored: each secret given sealed, each mask replaced by the secret
    stored at its place in `stored`, environment references as they are. Check it with
    `transport_credential_problems` first."""
    return _replaced(transport, lambda value, place, name: _sealed(value, kept=_stored_at(stored, place, name)))


def _shown(value: Any) -> Any:
    if isinstance(value, dict) and isinstance(value.get(SEALED), str):
        try:
            return f"{MASK} ({secret_fingerprint(secret_unseal(value[SEALED]))})"
        except SecretUnreadable:
            return f"{MASK} (unreadable with the configured keys)"
    if isinstance(value, dict) and set(value) == {ENV}:
        return dict(value)
    return MASK  # anything else stored there (written by SQL) is never shown either


def transport_shown(transport: dict[str, Any]) -> dict[str, Any]:
    """The transport as the API, the admin and the audit log show it: secrets masked."""
    if not isinstance(transport, dict):
        return transport
    return _replaced(transport, lambda value, place, name: _shown(value))


def transport_resealed(transport: dict[str, Any]) -> dict[str, Any]:
    """The transport with each sealed secret sealed again under the current key (rotation).
    Raises SecretUnreadable when one cannot be unsealed."""
    return _replaced(
        transport,
        lambda value, place, name: (
            {SEALED: secret_reseal(value[SEALED])} if isinstance(value, dict) and SEALED in value else value
        ),
    )


# --- used -----------------------------------------------------------------------------------------


def _revealed(value: Any, *, place: str, executor: str) -> str:
    if isinstance(value, dict) and isinstance(value.get(SEALED), str):
        try:
            return secret_unseal(value[SEALED])
        except SecretUnreadable as exc:
            raise SecretUnavailable(f"executor {executor}: transport.{place}: {exc}") from None
    if isinstance(value, dict) and isinstance(value.get(ENV), str):
        if found := os.environ.get(value[ENV]):
            return found
        raise SecretUnavailable(
            f"environment variable {value[ENV]} (transport.{place} of {executor}) is not set on this worker"
        )
    if isinstance(value, str):
        return value  # stored in clear by SQL or before sealing: still what the operator meant
    raise SecretUnavailable(f"executor {executor}: transport.{place} is not a secret this process can read")


def transport_headers(transport: dict[str, Any], *, executor: str) -> dict[str, str]:
    """The headers that carry the transport's credentials: `Authorization: Bearer` from api_key or
    api_key_env, then transport.headers. Raises SecretUnavailable."""
    headers: dict[str, str] = {}
    if "api_key" in transport:
        headers["Authorization"] = f"Bearer {_revealed(transport['api_key'], place='api_key', executor=executor)}"
    elif name := transport.get("api_key_env"):
        headers["Authorization"] = f"Bearer {_revealed({ENV: name}, place='api_key_env', executor=executor)}"
    for header, value in (transport.get("headers") or {}).items():
        headers[header] = _revealed(value, place=f"headers.{header}", executor=executor)
    return headers


def transport_secret(transport: dict[str, Any], name: str, *, executor: str) -> str | None:
    """A custom driver's own secret, transport.secrets.<name>, or None when it has none by that
    name. Raises SecretUnavailable."""
    value = (transport.get("secrets") or {}).get(name)
    return None if value is None else _revealed(value, place=f"secrets.{name}", executor=executor)


# --- from before: plain secrets -------------------------------------------------------------------


def _pop_secret_named(value: Any, path: str) -> list[tuple[str, Any]]:
    """Remove, in place, every entry under `value` whose name reads as a secret's; the removed
    entries by path."""
    removed: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        for key in list(value):
            inner = f"{path}.{key}" if path else str(key)
            if is_secret_name(str(key)):
                removed.append((inner, value.pop(key)))
            else:
                removed += _pop_secret_named(value[key], inner)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            removed += _pop_secret_named(item, f"{path}[{index}]")
    return removed


def plain_secrets_moved(
    *, endpoint: str | None, transport: Any, meta: Any
) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
    """An executor's endpoint, transport and meta with every secret stored in clear moved where it
    goes now, sealed (the data migration's step, executors/migrations/0008): nothing is lost, and
    what was sent to the server still is.

    * a user and password in the endpoint, which the HTTP client sent as Basic credentials: now
      transport.headers.Authorization (beside an API key, which the client refused to combine with
      them: transport.secrets."endpoint.userinfo"); a secret-named query parameter:
      transport.secrets."endpoint.<name>". Both leave the URL;
    * transport.api_key (beside api_key_env: transport.secrets.api_key), transport.headers and
      transport.secrets: sealed where they are;
    * any other secret-named entry of transport or meta, at any depth (`meta.api_key`, which no
      driver read): transport.secrets."<transport or meta>.<its path>", for a custom driver."""
    transport = copy.deepcopy(transport) if isinstance(transport, dict) else {}
    meta = copy.deepcopy(meta) if isinstance(meta, dict) else {}
    headers = transport.pop("headers", {})
    secrets = transport.pop("secrets", {})
    if not isinstance(secrets, dict):
        secrets = {"transport.secrets": secrets}
    if not isinstance(headers, dict):
        secrets["transport.headers"] = headers
        headers = {}
    if "api_key" in transport and "api_key_env" in transport:
        secrets["api_key"] = transport.pop("api_key")
    keyed = "api_key" in transport or "api_key_env" in transport

    if endpoint:
        parts = urlsplit(endpoint)
        if parts.username is not None or parts.password is not None:
            pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            basic = f"Basic {b64encode(pair.encode()).decode()}"
            if keyed or any(str(h).lower() == "authorization" for h in headers):
                secrets["endpoint.userinfo"] = basic
            else:
                headers["Authorization"] = basic
        query = parse_qsl(parts.query, keep_blank_values=True)
        secrets.update({f"endpoint.{name}": value for name, value in query if is_secret_name(name)})
        kept = urlencode([(name, value) for name, value in query if not is_secret_name(name)])
        endpoint = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, kept, parts.fragment))

    for where, root in (("transport", transport), ("meta", meta)):
        for key in [k for k in root if where == "meta" or k not in ("api_key", "api_key_env")]:
            if is_secret_name(str(key)):
                secrets[f"{where}.{key}"] = root.pop(key)
            else:
                secrets.update(_pop_secret_named(root[key], f"{where}.{key}"))

    def sealed(value: Any) -> Any:
        if isinstance(value, dict) and (isinstance(value.get(SEALED), str) or set(value) == {ENV}):
            return value
        return {SEALED: secret_seal(value if isinstance(value, str) else json.dumps(value))}

    if "api_key" in transport:
        transport["api_key"] = sealed(transport["api_key"])
    if headers:
        transport["headers"] = {str(name): sealed(value) for name, value in headers.items()}
    if secrets:
        transport["secrets"] = {str(name): sealed(value) for name, value in secrets.items()}
    return endpoint, transport, meta
