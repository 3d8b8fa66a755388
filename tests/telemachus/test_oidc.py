"""Sign-in through OpenID Connect against a real provider process (tests/oidc/): a browserless
authorization code flow, users created at the first sign-in, teams' roles and the operator role
from the groups claim on every sign-in (added and removed, audited), local passwords still there
for a break-glass admin; ID tokens from another issuer or signed by another key refused."""

import re

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import SuspiciousOperation
from django.test import Client

from telemachus.models import AuditEvent, ExternalIdentity, Membership
from telemachus.teams import rbac
from tests.oidc import (
    CLIENT_ID,
    CLIENT_SECRET,
    _follow,
    id_token_direct,
    needs_provider,
    provider_forms,
    provider_start,
    signing_key,
)
from tests.processes import free_port, responds, wait_until

CAROL = {"email": "carol@example.test", "preferred_username": "carol", "name": "Carol", "given_name": "Carol"}


def relying_party(processes, port: int, issuer: str) -> str:
    """The API server (dashboard and admin) as a relying party of `issuer`, on `port`."""
    processes.spawn(
        f"rp-{port}",
        "-m",
        "telemachus.serve",
        "127.0.0.1",
        str(port),
        TELEMACHUS_OIDC_ISSUER=issuer,
        TELEMACHUS_OIDC_CLIENT_ID=CLIENT_ID,
        TELEMACHUS_OIDC_CLIENT_SECRET=CLIENT_SECRET,
        TELEMACHUS_OIDC_NAME="Example SSO",
        TELEMACHUS_OIDC_SCOPES="openid email profile groups",
        TELEMACHUS_OIDC_TEAM_GROUPS="eng=a:member,eng-leads=a:manager,eng-leads=b:member",
        TELEMACHUS_OIDC_OPERATOR_GROUPS="platform",
    )
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: responds(f"{base}/healthz"), timeout=60, what="the relying party to listen")
    return base


def sign_in(base: str, login: str, next_url: str = "/dashboard/") -> tuple[httpx.Client, httpx.Response]:
    """A person who opens the sign-in button and answers the provider's pages."""
    client = httpx.Client(timeout=30)
    first = _follow(client, client.get(f"{base}/oidc/authenticate/", params={"next": next_url}), None)
    return client, provider_forms(client, first, login=login)


def roles(username: str) -> dict[str, str]:
    return dict(Membership.objects.filter(user__username=username).values_list("team__slug", "role"))


@needs_provider
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_sign_in_creates_the_user_and_keeps_roles_from_the_groups(processes, make_team, make_user):
    # Given teams a, b and c (c managed locally), and a provider where carol leads engineering...
    make_team("a"), make_team("b")
    team_c = make_team("c")
    port = free_port()
    idp = provider_start(
        processes,
        name="idp",
        key=signing_key("k1"),
        accounts={"carol": {**CAROL, "groups": ["eng-leads", "platform"]}},
        redirect_uris=[f"http://127.0.0.1:{port}/oidc/callback/"],
    )
    base = relying_party(processes, port, idp.issuer)
    page = httpx.get(f"{base}/login/").text
    assert "Sign in with Example SSO" in page and 'name="password"' in page

    # When she signs in through it...
    client, landed = sign_in(base, "carol")

    # Then she is on the dashboard, a new user linked to the provider's subject, with no password,
    # manager of a, member of b, an operator; each change audited as the provider's doing.
    assert landed.status_code == 200 and str(landed.url) == f"{base}/dashboard/", landed.text[:300]
    carol = get_user_model().objects.get(username="carol")
    assert (carol.email, carol.has_usable_password()) == ("carol@example.test", False)
    assert ExternalIdentity.objects.get(user=carol).issuer == idp.issuer
    assert roles("carol") == {"a": "manager", "b": "member"}
    assert rbac.is_operator(carol) and carol.is_staff and not carol.is_superuser
    assert client.get(f"{base}/api/queue/").status_code == 200  # her session works for the API too
    audited = list(AuditEvent.objects.filter(source="sso").order_by("id"))
    assert [e.action for e in audited] == ["user.create", "team.member_add", "team.member_add", "user.roles"]

    # Given a membership made by team c's manager, and carol moved to plain engineering...
    Membership.objects.create(team=team_c, user=carol, role="member")
    idp.accounts_set({"carol": {**CAROL, "groups": ["eng"]}})
    # When she signs in again, then the mapped teams follow her groups; c is left as it was.
    assert sign_in(base, "carol")[1].status_code == 200
    assert roles("carol") == {"a": "member", "c": "member"}
    carol = get_user_model().objects.get(pk=carol.pk)  # a fresh object: no cached permissions
    assert not rbac.is_operator(carol) and not carol.is_staff
    assert get_user_model().objects.filter(username__startswith="carol").count() == 1  # the same user
    later = AuditEvent.objects.filter(source="sso", pk__gt=audited[-1].pk).order_by("id")
    assert [(e.action, e.object_id) for e in later] == [
        ("team.member_role", "a"),
        ("team.member_remove", "b"),
        ("user.roles", "carol"),
    ]

    # And with no group at all, she keeps her user and loses the mapped teams.
    idp.accounts_set({"carol": {**CAROL, "groups": []}})
    assert sign_in(base, "carol")[1].status_code == 200
    assert roles("carol") == {"c": "member"}

    # The break-glass admin still signs in with a password, to the admin.
    make_user("root", is_superuser=True, is_staff=True)
    with httpx.Client(timeout=30) as admin:
        form = admin.get(f"{base}/admin/login/")
        assert "Sign in with Example SSO" in form.text
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
        signed = admin.post(
            f"{base}/admin/login/?next=/admin/",
            data={"csrfmiddlewaretoken": token, "username": "root", "password": "pw", "next": "/admin/"},
        )
        assert signed.status_code == 302 and signed.headers["location"] == "/admin/"
        assert admin.get(f"{base}/admin/").status_code == 200


@needs_provider
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_provider_that_names_another_issuer_signs_nobody_in(processes):
    """The relying party expects http://localhost:P; the provider there calls itself
    http://127.0.0.1:P: its discovery document is refused, and so is the sign-in."""
    port = free_port()
    idp = provider_start(
        processes,
        name="idp",
        key=signing_key("k1"),
        accounts={"carol": {**CAROL, "groups": ["eng"]}},
        redirect_uris=[f"http://127.0.0.1:{port}/oidc/callback/"],
    )
    base = relying_party(processes, port, f"http://localhost:{idp.port}")
    with httpx.Client(timeout=30) as client:
        answer = client.get(f"{base}/oidc/authenticate/")
    assert answer.status_code == 302 and answer.headers["location"] == "/login/?sso=failed"
    assert not get_user_model().objects.filter(username="carol").exists()


@needs_provider
@pytest.mark.slow
@pytest.mark.django_db
def test_id_tokens_of_another_issuer_or_key_are_refused(processes, settings):
    """Real ID tokens from three provider processes, checked as the callback checks them: A's
    passes; B's (another issuer, A's very key) is refused for its issuer; C's (A's issuer name,
    another key under the same key id) for its signature."""
    shared = signing_key("k1")
    a = provider_start(processes, name="a", key=shared, accounts={"carol": CAROL}, redirect_uris=[])
    b = provider_start(processes, name="b", key=shared, accounts={"carol": CAROL}, redirect_uris=[])
    c = provider_start(
        processes, name="c", key=signing_key("k1"), accounts={"carol": CAROL}, redirect_uris=[], issuer=a.issuer
    )
    from telemachus.teams.oidc import OidcBackend, provider_metadata_forget

    settings.TELEMACHUS_OIDC_ISSUER = a.issuer
    settings.OIDC_RP_CLIENT_ID, settings.OIDC_RP_CLIENT_SECRET = CLIENT_ID, CLIENT_SECRET
    settings.OIDC_RP_SIGN_ALGO, settings.OIDC_TIMEOUT = "RS256", 10
    provider_metadata_forget()
    backend = OidcBackend()
    try:
        claims = backend.verify_token(id_token_direct(a, login="carol", nonce="n-a"), nonce="n-a")
        assert (claims["iss"], claims["aud"], claims["sub"]) == (a.issuer, CLIENT_ID, "carol")
        with pytest.raises(SuspiciousOperation, match="Invalid issuer"):
            backend.verify_token(id_token_direct(b, login="carol", nonce="n-b"), nonce="n-b")
        with pytest.raises(SuspiciousOperation, match="verification failed"):
            backend.verify_token(id_token_direct(c, login="carol", nonce="n-c"), nonce="n-c")
    finally:
        provider_metadata_forget()


def test_off_without_an_issuer(db):
    """The sign-in page as it was, and no single sign-on route."""
    client = Client()
    page = client.get("/login/").content.decode()
    assert "Sign in with" not in page and 'class="sso"' not in page
    assert client.get("/oidc/authenticate/").status_code == 404
    assert "Sign in with" not in client.get("/admin/login/").content.decode()
