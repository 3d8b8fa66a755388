"""Apps' API keys and people's tokens over the REST API: made once, stored as digests, acting for
their team only, refused from the moment they are revoked, and guessed at a limited rate."""

import json
from datetime import timedelta
from io import StringIO
from types import SimpleNamespace

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from scheduler.models import Job
from telemachus.errors import ValidationFailed
from telemachus.keys.digests import secret_digest
from telemachus.keys.models import ApiKey, PersonalToken
from telemachus.keys.services import api_key_create, api_key_revoke
from telemachus.models import AuditEvent, Membership
from tests.conftest import chat_body
from tests.credentials import token_for

pytestmark = pytest.mark.django_db


def bearer(secret: str, keyword: str = "Bearer") -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"{keyword} {secret}")
    return client


@pytest.fixture
def manager(make_user, member_setup):
    """carol manages team a (alice is a member there)."""
    carol = make_user("carol")
    Membership.objects.create(team=member_setup[2], user=carol, role="manager")
    carol.groups.add(member_setup[2].group)
    return carol


def created_key(api, manager, **body) -> dict:
    response = api(manager).post("/api/keys/", {"team": "a", "name": "search app", **body}, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


class TestCreate:
    def test_a_manager_gets_the_secret_once_and_only_a_digest_is_kept(self, api, manager):
        body = created_key(api, manager, models=["m"])
        secret = body["key"]
        assert secret.startswith("tm-") and len(secret) == 35  # 192 random bits, URL-safe
        assert body["prefix"] == secret[:8] and body["team"] == "a" and body["models"] == ["m"]
        assert body["created_by"] == "carol" and body["revoked"] is False and body["principal"] == f"key:{body['id']}"
        key = ApiKey.objects.get(pk=body["id"])
        assert key.digest == secret_digest(secret) and secret not in key.digest

        # No read shows it again.
        listed = api(manager).get("/api/keys/?team=a")
        detail = api(manager).get(f"/api/keys/{key.pk}/")
        assert listed.status_code == detail.status_code == 200
        assert secret not in listed.content.decode() and "key" not in detail.json()
        assert detail.json()["prefix"] == body["prefix"]
        # The audit log records who made which key, without the secret.
        event = AuditEvent.objects.get(action="api_key.create")
        assert event.actor_name == "carol" and event.after["prefix"] == body["prefix"]
        assert secret not in json.dumps([event.before, event.after, event.object_repr])

    def test_a_member_sees_keys_but_may_not_make_them_and_others_see_nothing(self, api, manager, member_setup):
        alice, bob = member_setup[0], member_setup[1]
        body = created_key(api, manager)
        refused = api(alice).post("/api/keys/", {"team": "a", "name": "mine"}, format="json")
        assert refused.status_code == 403 and refused.json()["error"] == "forbidden"
        assert [k["id"] for k in api(alice).get("/api/keys/").json()["results"]] == [body["id"]]
        assert api(alice).delete(f"/api/keys/{body['id']}/").status_code == 403
        assert api(bob).get(f"/api/keys/{body['id']}/").status_code == 404
        assert api(bob).post("/api/keys/", {"team": "a", "name": "x"}, format="json").status_code == 404
        assert api(bob).get("/api/keys/").json()["results"] == []

    def test_an_operator_makes_keys_for_any_team(self, api, operator, member_setup):
        response = api(operator).post("/api/keys/", {"team": "b", "name": "etl"}, format="json")
        assert response.status_code == 201 and response.json()["team"] == "b"

    def test_bad_input(self, api, manager):
        client = api(manager)
        created_key(api, manager)
        taken = client.post("/api/keys/", {"team": "a", "name": "search app"}, format="json")
        assert taken.status_code == 400 and "name" in taken.json()["fields"]
        past = client.post(
            "/api/keys/",
            {"team": "a", "name": "old", "expires_at": (timezone.now() - timedelta(hours=1)).isoformat()},
            format="json",
        )
        assert past.status_code == 400 and "expires_at" in past.json()["fields"]
        assert client.post("/api/keys/", {"team": "a", "name": "x", "secret": "y"}, format="json").status_code == 400


class TestUse:
    def test_a_key_submits_for_its_team_as_its_own_user(self, api, manager, member_setup):
        body = created_key(api, manager)
        for keyword in ("Bearer", "Token"):
            response = bearer(body["key"], keyword).post("/api/jobs/", {**chat_body("a"), "team": None}, format="json")
            assert response.status_code == 400  # a null team is still a bad team
            chat = chat_body("a")
            del chat["team"]
            response = bearer(body["key"], keyword).post("/api/jobs/", chat, format="json")
            assert response.status_code == 201, response.json()
            job = Job.objects.get(pk=response.json()["id"])
            assert (job.team.slug, job.user.username, job.key_id) == ("a", f"key:{body['id']}", body["id"])
            assert response.json()["key"] == body["id"] and response.json()["cost"] == "0"
        # It sees its own jobs, and not the team's other members' (it is a plain member).
        alices = api(member_setup[0]).post("/api/jobs/", chat_body("a"), format="json").json()["id"]
        seen = {j["id"] for j in bearer(body["key"]).get("/api/jobs/").json()["results"]}
        assert alices not in seen and len(seen) == 2
        assert bearer(body["key"]).get(f"/api/jobs/{alices}/").status_code == 404
        # Another team's name reads as a team it is not in.
        elsewhere = bearer(body["key"]).post("/api/jobs/", chat_body("b"), format="json")
        assert elsewhere.status_code == 400 and "team" in elsewhere.json()["fields"]
        assert ApiKey.objects.get(pk=body["id"]).last_used_at is not None

    def test_a_key_runs_work_and_manages_nothing(self, api, manager):
        key = bearer(created_key(api, manager)["key"])
        for path in ("/api/teams/", "/api/keys/", "/api/queue/", "/api/usage/", "/api/executors/", "/api/policy/"):
            response = key.get(path)
            assert response.status_code == 403, path
            assert response.json()["error"] == "forbidden"
        assert key.post("/api/keys/", {"team": "a", "name": "child"}, format="json").status_code == 403
        assert key.get("/api/spend/").status_code == 200

    def test_the_model_list_is_enforced(self, api, manager, make_executor):
        make_executor("other-box", models=["other"])
        body = created_key(api, manager, models=["m"])
        refused = bearer(body["key"]).post("/api/jobs/", chat_body("a", model="other"), format="json")
        assert refused.status_code == 400
        assert refused.json()["error"] == "unknown_model" and refused.json()["model"] == "other"
        assert "'other'" in refused.json()["detail"]
        assert bearer(body["key"]).post("/api/jobs/", chat_body("a", model="m"), format="json").status_code == 201
        bulk = bearer(body["key"]).post(
            "/api/jobs/bulk/", {"jobs": [chat_body("a"), chat_body("a", model="other")]}, format="json"
        )
        assert bulk.status_code == 400 and bulk.json()["index"] == 1
        # A person of the same team is not bound by the key's list.
        assert api(manager).post("/api/jobs/", chat_body("a", model="other"), format="json").status_code == 201

    def test_revoked_and_expired_keys_are_refused(self, api, manager):
        body = created_key(api, manager)
        key = bearer(body["key"])
        chat = chat_body("a")
        queued = key.post("/api/jobs/", chat, format="json").json()["id"]
        assert api(manager).delete(f"/api/keys/{body['id']}/").status_code == 204
        refused = key.get("/api/jobs/")
        assert refused.status_code == 401 and refused.json()["error"] == "not_authenticated"
        assert refused.headers["WWW-Authenticate"] == "Token"
        # Its queued work is canceled with it; the revoke is audited.
        assert Job.objects.get(pk=queued).status == "canceled"
        assert AuditEvent.objects.filter(action="api_key.revoke", object_id=str(body["id"])).count() == 1
        assert api(manager).get(f"/api/keys/{body['id']}/").json()["revoked"] is True
        assert api(manager).delete(f"/api/keys/{body['id']}/").status_code == 204  # again: nothing changes

        other = created_key(api, manager, name="nightly")
        ApiKey.objects.filter(pk=other["id"]).update(expires_at=timezone.now() - timedelta(seconds=1))
        assert bearer(other["key"]).get("/api/jobs/").status_code == 401

    def test_a_keys_user_is_the_keys_to_manage(self, api, manager, operator):
        body = created_key(api, manager)
        principal = body["principal"]
        promote = api(operator).post("/api/teams/a/members/", {"username": principal, "role": "manager"}, format="json")
        assert promote.status_code == 400
        assert api(operator).delete(f"/api/teams/a/members/{principal}/").status_code == 409
        assert Membership.objects.get(user__username=principal).role == "member"


class TestFailures:
    @override_settings(TELEMACHUS_AUTH_FAILURES_PER_ADDRESS=3, TELEMACHUS_AUTH_FAILURE_WINDOW_SECONDS=60)
    def test_bad_credentials_never_lock_out_good_ones(self, api, manager, member_setup):
        good = created_key(api, manager)["key"]
        alice_token = token_for(member_setup[0])
        for guess in range(3):
            assert bearer(f"tm-guess{guess}").get("/api/jobs/").status_code == 401
        throttled = bearer("tm-guess4").get("/api/jobs/")
        assert throttled.status_code == 429 and throttled.json()["error"] == "throttled"
        assert 0 < int(throttled.headers["Retry-After"]) <= 60
        # From the same address, over its limit: every right key and token is served, in both
        # header forms, while the wrong ones stay refused.
        for _ in range(30):
            assert bearer(good).get("/api/jobs/").status_code == 200
            assert bearer(alice_token, "Token").get("/api/jobs/").status_code == 200
            assert bearer(f"tm-{_:05d}").get("/api/jobs/").status_code == 429
        assert bearer(alice_token).get("/api/jobs/").status_code == 200

    @override_settings(TELEMACHUS_AUTH_FAILURES_PER_ADDRESS=1000, TELEMACHUS_AUTH_FAILURES_PER_CREDENTIAL=3)
    def test_guessing_one_key_from_many_addresses_is_answered_as_from_one(self, api, manager):
        good = created_key(api, manager)["key"]
        known_prefix = good[:8]  # what a key list shows
        codes = []
        for attempt in range(5):
            guesser = APIClient(REMOTE_ADDR=f"10.0.1.{attempt}")
            guesser.credentials(HTTP_AUTHORIZATION=f"Bearer {known_prefix}{attempt:027d}")
            codes.append(guesser.get("/api/jobs/").status_code)
        assert codes == [401, 401, 401, 429, 429]
        # The key whose prefix was guessed at still works, from anywhere.
        owner = APIClient(REMOTE_ADDR="10.0.1.0")
        owner.credentials(HTTP_AUTHORIZATION=f"Bearer {good}")
        assert owner.get("/api/jobs/").status_code == 200
        # Another prefix's failures are counted on their own.
        assert bearer("tm-other0000").get("/api/jobs/").status_code == 401


class TestPersonalTokens:
    def test_drf_create_token_prints_a_usable_token_each_time(self, make_user, member_setup):
        out = StringIO()
        call_command("drf_create_token", "alice", stdout=out)
        first = out.getvalue().split()[2]
        out = StringIO()
        call_command("drf_create_token", "alice", stdout=out)
        second = out.getvalue().split()[2]
        assert out.getvalue() == f"Generated token {second} for user alice\n" and first != second
        assert bearer(first, "Token").get("/api/jobs/").status_code == 200
        assert bearer(second).get("/api/jobs/").status_code == 200
        assert not PersonalToken.objects.filter(digest__in=[first, second]).exists()
        call_command("drf_create_token", "alice", "--reset", stdout=StringIO())
        assert bearer(first).get("/api/jobs/").status_code == 401
        assert PersonalToken.objects.filter(user__username="alice").count() == 1

    def test_a_keys_user_has_no_token(self, api, manager):
        from telemachus.keys.services import personal_token_issue

        body = created_key(api, manager)
        principal = ApiKey.objects.get(pk=body["id"]).principal
        with pytest.raises(ValidationFailed) as refused:
            personal_token_issue(user=principal)
        assert "authenticates with its key" in str(refused.value.extra["fields"])


def test_legacy_tokens_move_to_digests(member_setup):
    """Tokens DRF stored in plain text become digests (the secret keeps working) and the plain
    rows are deleted: the migration's step, on a table laid out as DRF's."""
    import importlib

    migration = importlib.import_module("telemachus.migrations.0005_api_keys")
    alice = member_setup[0]
    qn = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE {qn('authtoken_token')} ({qn('key')} varchar(40) PRIMARY KEY, "
            f"{qn('created')} timestamp NULL, {qn('user_id')} integer NOT NULL)"
        )
        cursor.execute(
            f"INSERT INTO {qn('authtoken_token')} ({qn('key')}, {qn('user_id')}) VALUES (%s, %s)",
            ["0123456789abcdef0123456789abcdef01234567", alice.pk],
        )
    from django.apps import apps

    migration.tokens_to_digests(apps, SimpleNamespace(connection=connection))
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {qn('authtoken_token')}")
        assert cursor.fetchone()[0] == 0
    moved = PersonalToken.objects.get(user=alice)
    assert moved.prefix == "0123" and moved.name == "migrated"
    assert bearer("0123456789abcdef0123456789abcdef01234567", "Token").get("/api/jobs/").status_code == 200


def test_key_services_alone(member_setup, make_user):
    """Revoking twice is one revoke; the key's user goes inactive with it."""
    key, secret = api_key_create(team=member_setup[2], name="svc", by=None)
    api_key_revoke(key=key, by=None)
    api_key_revoke(key=key, by=None)
    key.principal.refresh_from_db()
    assert key.principal.is_active is False
    assert AuditEvent.objects.filter(action="api_key.revoke").count() == 1
    assert secret.startswith("tm-")
