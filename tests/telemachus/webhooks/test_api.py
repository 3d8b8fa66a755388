"""/api/webhooks/: who registers and sees webhooks, the secret shown once, URLs that are refused."""

import pytest

from telemachus.models import AuditEvent, Webhook
from telemachus.webhooks.services import WebhookEvent, webhooks_emit

pytestmark = pytest.mark.django_db

RECEIVER = "http://127.0.0.1:9/hooks"  # never called here: registration resolves, it does not connect


@pytest.fixture
def teams(make_user, make_team):
    """Given manager mia and member max in team a, manager bea in team b."""
    mia, max_, bea = make_user("mia"), make_user("max"), make_user("bea")
    return make_team("a", {mia: "manager", max_: "member"}), make_team("b", {bea: "manager"}), mia, max_, bea


def create(client, team="a", url=RECEIVER, events=("job.failed",)):
    return client.post("/api/webhooks/", {"team": team, "url": url, "events": list(events)}, format="json")


class TestRegister:
    def test_the_secret_is_shown_once(self, api, teams, private_allowed):
        _, _, mia, _, _ = teams
        client = api(mia)
        created = create(client, events=["job.failed", "budget.exhausted"])
        assert created.status_code == 201, created.json()
        body = created.json()
        assert body["secret"].startswith("whsec_") and created["Cache-Control"] == "no-store"
        assert (body["team"], body["url"], body["events"]) == ("a", RECEIVER, ["job.failed", "budget.exhausted"])
        shown = [client.get(f"/api/webhooks/{body['id']}/").json(), client.get("/api/webhooks/").json()["results"][0]]
        assert all("secret" not in view for view in shown)
        assert body["secret"] not in str(list(AuditEvent.objects.values()))
        audit = AuditEvent.objects.get(action="webhook.create")
        assert (audit.actor_name, audit.after["url"]) == ("mia", RECEIVER)

    def test_an_operator_registers_for_any_team(self, api, teams, operator, private_allowed):
        assert create(api(operator), team="b").status_code == 201

    def test_a_member_may_not(self, api, teams, private_allowed):
        _, _, _, max_, _ = teams
        answer = create(api(max_))
        assert answer.status_code == 403 and answer.json()["permission"] == "team:manage"

    def test_another_teams_webhooks_are_invisible(self, api, teams, private_allowed):
        _, _, mia, _, bea = teams
        hook_id = create(api(mia)).json()["id"]
        stranger = api(bea)
        assert stranger.get("/api/webhooks/").json()["results"] == []
        for answer in (
            stranger.get(f"/api/webhooks/{hook_id}/"),
            stranger.get(f"/api/webhooks/{hook_id}/deliveries/"),
            stranger.patch(f"/api/webhooks/{hook_id}/", {"enabled": False}, format="json"),
            stranger.delete(f"/api/webhooks/{hook_id}/"),
            create(stranger, team="a"),
        ):
            assert answer.status_code == 404, answer.json()
        assert Webhook.objects.get(pk=hook_id).enabled

    def test_unknown_events_are_refused(self, api, teams, private_allowed):
        _, _, mia, _, _ = teams
        answer = create(api(mia), events=["job.failed", "job.exploded"])
        assert answer.status_code == 400 and "events" in answer.json()["fields"]


class TestAddresses:
    @pytest.mark.parametrize(
        ("url", "kind"),
        [
            ("http://127.0.0.1:8000/hook", "loopback"),
            ("http://localhost/hook", "loopback"),
            ("http://10.1.2.3/hook", "private"),
            ("http://192.168.0.10/hook", "private"),
            ("http://169.254.169.254/latest/meta-data", "link-local"),
            ("http://[::1]/hook", "loopback"),
            ("http://[::ffff:127.0.0.1]/hook", "loopback"),
            ("http://0.0.0.0/hook", "unspecified"),
        ],
    )
    def test_private_addresses_are_refused(self, api, teams, url, kind):
        _, _, mia, _, _ = teams
        answer = create(api(mia), url=url)
        assert answer.status_code == 400
        assert f"({kind})" in answer.json()["fields"]["url"][0]
        assert not Webhook.objects.exists()

    def test_other_schemes_and_credentials_are_refused(self, api, teams, private_allowed):
        _, _, mia, _, _ = teams
        for url in ("ftp://127.0.0.1/x", "http://user:pw@127.0.0.1/x"):
            assert create(api(mia), url=url).status_code == 400

    def test_a_changed_url_is_checked_again(self, api, teams, private_allowed, settings):
        _, _, mia, _, _ = teams
        hook_id = create(api(mia)).json()["id"]
        settings.TELEMACHUS_WEBHOOKS_ALLOW_PRIVATE = False
        answer = api(mia).patch(f"/api/webhooks/{hook_id}/", {"url": "http://10.0.0.1/x"}, format="json")
        assert answer.status_code == 400 and Webhook.objects.get(pk=hook_id).url == RECEIVER


class TestManage:
    def test_update_and_delete_are_audited(self, api, teams, private_allowed):
        _, _, mia, _, _ = teams
        client = api(mia)
        hook_id = create(client).json()["id"]
        answer = client.patch(
            f"/api/webhooks/{hook_id}/", {"enabled": False, "events": ["executor.down"]}, format="json"
        )
        assert answer.status_code == 200 and answer.json()["enabled"] is False
        update = AuditEvent.objects.get(action="webhook.update")
        assert update.before == {"events": ["job.failed"], "enabled": True}
        assert update.after == {"events": ["executor.down"], "enabled": False}
        assert client.delete(f"/api/webhooks/{hook_id}/").status_code == 204
        assert not Webhook.objects.exists() and AuditEvent.objects.filter(action="webhook.delete").exists()

    def test_emit_reaches_subscribed_enabled_webhooks_of_the_teams_concerned(self, api, teams, private_allowed):
        a, b, mia, _, bea = teams
        wanted = create(api(mia)).json()["id"]
        create(api(mia), events=["executor.down"])  # another type
        create(api(bea), team="b")  # another team
        off = create(api(mia)).json()["id"]
        api(mia).patch(f"/api/webhooks/{off}/", {"enabled": False}, format="json")
        assert (
            webhooks_emit(events=[WebhookEvent(type="job.failed", data={"job": {"id": 7}}, teams=frozenset({a.pk}))])
            == 1
        )
        (delivery,) = api(mia).get(f"/api/webhooks/{wanted}/deliveries/").json()["results"]
        assert delivery["status"] == "pending" and delivery["message_id"].startswith("msg_")
        assert delivery["payload"]["type"] == "job.failed"
        assert delivery["payload"]["data"] == {"job": {"id": 7}, "team": "a"}
        # None: every team's webhooks.
        assert webhooks_emit(events=[WebhookEvent(type="job.failed", data={}, teams=None)]) == 2
