"""A real OpenID Connect provider for the sign-in tests: the npm package `oidc-provider`
(tests/oidc/package.json, pinned; .ci/run installs it with `npm ci`), run by node as a process of
the test's (tests/oidc/provider.mjs), and a browserless user that signs in through it with httpx:
following redirects and posting the provider's login and consent forms as a browser would."""

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import parse_qs, urljoin, urlsplit

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.processes import ROOT, Processes, answers, free_port, wait_until

HERE = ROOT / "tests/oidc"
CLIENT_ID, CLIENT_SECRET = "telemachus", "telemachus-test-secret"
# Where a token is asked for directly (tests that want the raw ID token): never connected to.
DIRECT_REDIRECT = "http://127.0.0.1:9/callback"


def provider_installed() -> bool:
    return shutil.which("node") is not None and (HERE / "node_modules/oidc-provider").is_dir()


needs_provider = pytest.mark.skipif(
    not provider_installed(),
    reason="the test OpenID provider is not installed: run `npm ci --prefix tests/oidc` (.ci/run does)",
)


def signing_key(kid: str) -> dict:
    """A new RSA private key as a JWK, for a provider to sign with."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return {**jwt.algorithms.RSAAlgorithm.to_jwk(key, as_dict=True), "kid": kid, "use": "sig", "alg": "RS256"}


class IdentityProvider:
    """One provider process; `accounts` may be changed between sign-ins (`accounts_set`)."""

    def __init__(self, config_path: Path, issuer: str, port: int) -> None:
        self.config_path, self.issuer, self.port = config_path, issuer, port

    def accounts_set(self, accounts: dict) -> None:
        config = json.loads(self.config_path.read_text())
        self.config_path.write_text(json.dumps({**config, "accounts": accounts}))


def provider_start(
    processes: Processes, *, name: str, key: dict, accounts: dict, redirect_uris: list[str], issuer: str | None = None
) -> IdentityProvider:
    """Start a provider on a free loopback port (its issuer that address, unless `issuer` names
    another) with our client registered; returns once its discovery document answers."""
    port = free_port()
    issuer = issuer or f"http://127.0.0.1:{port}"
    config = processes.tmp_path / f"{name}.json"
    config.write_text(
        json.dumps(
            {
                "issuer": issuer,
                "port": port,
                "jwks": {"keys": [key]},
                "accounts": accounts,
                "clients": [
                    {
                        "client_id": CLIENT_ID,
                        "client_secret": CLIENT_SECRET,
                        "redirect_uris": [*redirect_uris, DIRECT_REDIRECT],
                        "grant_types": ["authorization_code"],
                        "response_types": ["code"],
                    }
                ],
            }
        )
    )
    log = open(processes.tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen(["node", "provider.mjs", str(config)], cwd=HERE, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = processes.tmp_path / f"{name}.log"
    processes.procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    wait_until(
        lambda: proc.poll() is not None or answers(f"{base}/.well-known/openid-configuration"),
        timeout=30,
        what=f"the OpenID provider {name} to listen",
    )
    assert proc.poll() is None, proc.log_path.read_text()
    return IdentityProvider(config, issuer, port)


class _Form(HTMLParser):
    """The first form of a page: its action and its inputs' names and values."""

    def __init__(self) -> None:
        super().__init__()
        self.action: str | None = None
        self.fields: dict[str, str] = {}
        self._inside = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "form" and self.action is None:
            self.action, self._inside = found.get("action") or "", True
        elif tag == "input" and self._inside and found.get("name"):
            self.fields[found["name"] or ""] = found.get("value") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._inside = False


def provider_forms(
    client: httpx.Client, page: httpx.Response, *, login: str, stop_at: str | None = None
) -> httpx.Response:
    """Answer the provider's pages as a person would: the login form (the account's name, any
    password), then the consent form, each posted where its page says, redirects followed (up to
    `stop_at`, a URL prefix the last redirect may not be followed to)."""
    for _ in range(5):
        if stop_at and page.is_redirect and page.headers["location"].startswith(stop_at):
            return page
        form = _Form()
        form.feed(page.text)
        if form.action is None or "prompt" not in form.fields:
            return page
        data = dict(form.fields)
        if data["prompt"] == "login":
            data.update(login=login, password="any password")
        page = _follow(client, client.post(urljoin(str(page.url), form.action), data=data), stop_at)
    raise AssertionError(f"the provider's pages did not end: {page.url}")


def _follow(client: httpx.Client, response: httpx.Response, stop_at: str | None) -> httpx.Response:
    while response.is_redirect:
        target = urljoin(str(response.url), response.headers["location"])
        if stop_at and target.startswith(stop_at):
            return response
        response = client.get(target)
    return response


def id_token_direct(provider: IdentityProvider, *, login: str, nonce: str) -> str:
    """An ID token from `provider`, asked for as our client would (code flow with PKCE), without
    the relying party: for tests that hand it to the verification themselves."""
    verifier = "v" * 64
    challenge = jwt.utils.base64url_encode(__import__("hashlib").sha256(verifier.encode()).digest()).decode()
    base = f"http://127.0.0.1:{provider.port}"
    with httpx.Client(timeout=30) as client:
        start = client.get(
            f"{base}/auth",
            params={
                "client_id": CLIENT_ID,
                "response_type": "code",
                "scope": "openid email profile groups",
                "redirect_uri": DIRECT_REDIRECT,
                "state": "s",
                "nonce": nonce,
                "code_challenge": challenge,
                "code_challenge_method": "S256",
            },
        )
        back = provider_forms(client, _follow(client, start, DIRECT_REDIRECT), login=login, stop_at=DIRECT_REDIRECT)
        code = parse_qs(urlsplit(back.headers["location"]).query)["code"][0]
        tokens = client.post(
            f"{base}/token",
            data={
                "grant_type": "authorization_code",
                "code": code,
                "redirect_uri": DIRECT_REDIRECT,
                "code_verifier": verifier,
            },
            auth=(CLIENT_ID, CLIENT_SECRET),
        )
        tokens.raise_for_status()
        return tokens.json()["id_token"]
