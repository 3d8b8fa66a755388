"""Every operator action leaves one audit event with who, through which surface, when, and the
fields before and after: through the API, the admin and (tests/scheduler/test_dashboard.py) the
dashboard alike; and GET /api/audit/ finds them."""

from datetime import timedelta

import pytest
from django.utils import timezone

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job
from scheduler.services.submit import job_submit
from telemachus.models import AuditEvent, FeatureSwitch, Team

pytestmark = pytest.mark.django_db

EXECUTOR = {
    "name": "gpu-1",
    "kind": "local-model",
    "endpoint": "http://127.0.0.1:9/v1",
    "capabilities": {"models": ["llama3"]},
    "max_concurrency": 2,
}


def only_event(action: str) -> AuditEvent:
    """The one event of `action` that a person caused (fixtures set teams up as the system)."""
    events = list(AuditEvent.objects.filter(action=action, actor__isnull=False))
    assert len(events) == 1, [str(e) for e in AuditEvent.objects.all()]
    return events[0]


def assert_by_operator(event: AuditEvent, source: str = "api") -> None:
    assert (event.actor_name, event.actor.username, event.source) == ("operator", "operator", source)
    assert abs(event.at - timezone.now()) < timedelta(minutes=1)


class TestApiActionsAreAudited:
    def test_executor_create_edit_delete(self, api, operator):
        client = api(operator)
        executor_id = client.post("/api/executors/", EXECUTOR, format="json").json()["id"]
        created = only_event("executor.create")
        assert_by_operator(created)
        assert (created.object_type, created.object_id, created.before) == ("executor", str(executor_id), None)
        assert created.after["max_concurrency"] == 2 and created.after["enabled"] is True

        client.patch(
            f"/api/executors/{executor_id}/",
            {"max_concurrency": 8, "enabled": False, "endpoint": "http://127.0.0.1:10/v1"},
            format="json",
        )
        edited = only_event("executor.update")
        assert_by_operator(edited)
        assert edited.before == {"endpoint": "http://127.0.0.1:9/v1", "max_concurrency": 2, "enabled": True}
        assert edited.after == {"endpoint": "http://127.0.0.1:10/v1", "max_concurrency": 8, "enabled": False}

        # An edit that changes nothing leaves nothing.
        client.patch(f"/api/executors/{executor_id}/", {"max_concurrency": 8}, format="json")
        assert AuditEvent.objects.filter(action="executor.update").count() == 1

        client.delete(f"/api/executors/{executor_id}/")
        deleted = only_event("executor.delete")
        assert deleted.before["name"] == "gpu-1" and deleted.after is None
        assert not Executor.objects.exists()

    def test_refused_edits_leave_no_event(self, api, operator, member_setup):
        executor = member_setup[4]
        assert (
            api(member_setup[0]).patch(f"/api/executors/{executor.pk}/", {"enabled": False}, format="json").status_code
            == 403
        )
        assert (
            api(operator).patch(f"/api/executors/{executor.pk}/", {"max_concurrency": -1}, format="json").status_code
            == 400
        )
        assert not AuditEvent.objects.filter(object_type="executor").exists()

    @pytest.mark.slow
    @pytest.mark.django_db(transaction=True)
    def test_executor_sync(self, api, operator, processes):
        base = processes.simllm(models="llama3,qwen")
        executor = Executor.objects.create(
            name="box", kind="local-model", endpoint=f"{base}/v1", capabilities={"models": ["old"], "class": "gpu"}
        )
        assert api(operator).post(f"/api/executors/{executor.pk}/sync/").status_code == 200
        synced = only_event("executor.sync")
        assert_by_operator(synced)
        assert synced.before == {"capabilities": {"models": ["old"], "class": "gpu"}}
        assert synced.after == {"capabilities": {"models": ["llama3", "qwen"], "class": "gpu"}}

    def test_quota_rule_create_edit_delete(self, api, operator, member_setup):
        client = api(operator)
        rule = {"scope": "team", "subject": "a", "dimension": "ai.tokens", "limit": 1000, "window": "day"}
        rule_id = client.post("/api/quota-policies/", rule, format="json").json()["id"]
        created = only_event("quota_policy.create")
        assert_by_operator(created)
        assert created.after == rule and created.object_id == str(rule_id)

        client.patch(f"/api/quota-policies/{rule_id}/", {"limit": 50}, format="json")
        assert (only_event("quota_policy.update").before, only_event("quota_policy.update").after) == (
            {"limit": 1000},
            {"limit": 50},
        )

        client.delete(f"/api/quota-policies/{rule_id}/")
        assert only_event("quota_policy.delete").before == {**rule, "limit": 50}

    def test_team_lifecycle_members_and_grants(self, api, operator, make_user):
        make_user("alice"), make_user("bob")
        client = api(operator)
        client.post(
            "/api/teams/",
            {"slug": "ml", "name": "ML", "members": [{"username": "alice", "role": "member"}]},
            format="json",
        )
        created = only_event("team.create")
        assert_by_operator(created)
        assert created.after == {
            "slug": "ml",
            "name": "ML",
            "members": {"alice": "member"},
            "grants": {"team": ["chat:use"], "users": {}},
        }

        client.post("/api/teams/ml/members/", {"username": "bob", "role": "member"}, format="json")
        assert only_event("team.member_add").after == {"username": "bob", "role": "member"}
        client.post("/api/teams/ml/members/", {"username": "bob", "role": "manager"}, format="json")
        role = only_event("team.member_role")
        assert (role.before, role.after) == (
            {"username": "bob", "role": "member"},
            {"username": "bob", "role": "manager"},
        )
        client.delete("/api/teams/ml/members/alice/")
        assert only_event("team.member_remove").before == {"username": "alice", "role": "member"}

        client.put(
            "/api/teams/ml/grants/",
            {"team": ["chat:use", "flows:run"], "users": {"alice": ["tools:invoke"]}},
            format="json",
        )
        grants = only_event("team.grants")
        assert grants.before == {"team": ["chat:use"], "users": {}}
        assert grants.after == {"team": ["chat:use", "flows:run"], "users": {"alice": ["tools:invoke"]}}

        client.patch("/api/teams/ml/", {"name": "Machine learning"}, format="json")
        assert only_event("team.update").after == {"name": "Machine learning"}
        client.delete("/api/teams/ml/")
        deleted = only_event("team.delete")
        assert deleted.object_id == "ml" and deleted.before["members"] == {"bob": "manager"}
        assert not Team.objects.filter(slug="ml").exists()

    def test_a_manager_adding_a_member_is_the_actor(self, api, member_setup, make_user, make_team):
        alice, _, team_a, *_ = member_setup
        carol = make_user("carol")
        make_team("c", {alice: "member", carol: "member"})  # managers add people they already work with
        team_a.memberships.filter(user=alice).update(role="manager")
        assert api(alice).post("/api/teams/a/members/", {"username": "carol"}, format="json").status_code == 201
        event = only_event("team.member_add")
        assert (event.actor_name, event.object_id) == ("alice", "a")

    def test_policy_cancel_requeue_feature_and_user(self, api, operator, member_setup):
        client = api(operator)
        client.put("/api/policy/", {"team_weights": {"a": 2}}, format="json")
        policy = only_event("queue_policy.update")
        assert (policy.before, policy.after) == ({"team_weights": {}}, {"team_weights": {"a": 2.0}})

        job = job_submit(
            user=member_setup[0],
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )
        client.post(f"/api/jobs/{job.pk}/cancel/")
        cancel = only_event("job.cancel")
        assert_by_operator(cancel)
        assert (cancel.object_id, cancel.before, cancel.after) == (
            str(job.pk),
            {"status": "queued"},
            {"status": "canceled"},
        )
        client.post(f"/api/jobs/{job.pk}/requeue/")
        assert only_event("job.requeue").after == {"status": "queued"}

        client.put("/api/features/", {"feature": "tool", "team": "a", "enabled": False}, format="json")
        feature = only_event("feature.set")
        assert (feature.object_id, feature.before, feature.after) == ("tool:a", {"enabled": None}, {"enabled": False})

        client.post("/api/users/", {"username": "dora", "password": "a long pass phrase 42"}, format="json")
        created = only_event("user.create")
        assert created.after["username"] == "dora" and "password" not in str(created.after)


def browser_user(client):
    return int(client.session["_auth_user_id"])


class TestAdminActionsAreAudited:
    @pytest.fixture
    def browser(self, client, operator):
        client.force_login(operator)
        return client

    def test_executor_list_edit_and_actions(self, browser, member_setup):
        executor = member_setup[4]
        response = browser.post(
            "/admin/executors/executor/",
            {
                "form-TOTAL_FORMS": "1",
                "form-INITIAL_FORMS": "1",
                "form-0-id": executor.pk,
                "form-0-enabled": "on",
                "form-0-max_concurrency": "9",
                "_save": "Save",
            },
        )
        assert response.status_code == 302, response.content[:2000]
        edited = only_event("executor.update")
        assert_by_operator(edited, "admin")
        assert (edited.before, edited.after) == ({"max_concurrency": 4}, {"max_concurrency": 9})

        browser.post("/admin/executors/executor/", {"action": "disable", "_selected_action": [executor.pk]})
        assert AuditEvent.objects.filter(action="executor.update").first().after == {"enabled": False}

        browser.post(f"/admin/executors/executor/{executor.pk}/delete/", {"post": "yes"})
        assert only_event("executor.delete").source == "admin"

    def test_quota_rule_add_and_delete(self, browser, member_setup):
        response = browser.post(
            "/admin/quotas/quotapolicy/add/",
            {
                "scope": "team",
                "subject": "a",
                "dimension": "ai.concurrency",
                "limit": "3",
                "window": "",
            },
        )
        assert response.status_code == 302, response.content[:2000]
        created = only_event("quota_policy.create")
        assert_by_operator(created, "admin")
        assert created.after == {
            "scope": "team",
            "subject": "a",
            "dimension": "ai.concurrency",
            "limit": 3,
            "window": None,
        }
        rule = QuotaPolicy.objects.get()
        browser.post(
            f"/admin/quotas/quotapolicy/{rule.pk}/change/",
            {
                "scope": "team",
                "subject": "a",
                "dimension": "ai.concurrency",
                "limit": "5",
                "window": "",
            },
        )
        assert only_event("quota_policy.update").after == {"limit": 5}
        browser.post(f"/admin/quotas/quotapolicy/{rule.pk}/delete/", {"post": "yes"})
        assert only_event("quota_policy.delete").source == "admin"

    def test_team_inline_members(self, browser, member_setup, make_user):
        alice, _, team_a, *_ = member_setup
        carol = make_user("carol")
        membership = team_a.memberships.get()
        response = browser.post(
            f"/admin/telemachus/team/{team_a.pk}/change/",
            {
                "slug": "a",
                "name": "Team A",
                "memberships-TOTAL_FORMS": "2",
                "memberships-INITIAL_FORMS": "1",
                "memberships-0-id": membership.pk,
                "memberships-0-team": team_a.pk,
                "memberships-0-user": alice.pk,
                "memberships-0-role": "member",
                "memberships-0-DELETE": "on",
                "memberships-1-team": team_a.pk,
                "memberships-1-user": carol.pk,
                "memberships-1-role": "manager",
            },
        )
        assert response.status_code == 302, response.content[:3000]
        assert only_event("team.update").after == {"name": "Team A"}
        assert only_event("team.member_remove").before == {"username": "alice", "role": "member"}
        assert only_event("team.member_add").after == {"username": "carol", "role": "manager"}
        assert {e.source for e in AuditEvent.objects.filter(actor=browser_user(browser))} == {"admin"}
        assert list(team_a.group.user_set.values_list("username", flat=True)) == ["carol"]

    def test_feature_switch(self, browser, member_setup):
        response = browser.post("/admin/telemachus/featureswitch/add/", {"feature": "flow", "team": "", "enabled": ""})
        assert response.status_code == 302, response.content[:2000]
        event = only_event("feature.set")
        assert_by_operator(event, "admin")
        assert (event.object_id, event.after) == ("flow:global", {"enabled": False})
        assert FeatureSwitch.objects.get().enabled is False

    def test_audit_log_is_read_only_in_the_admin(self, browser, api, operator, member_setup):
        api(operator).patch(f"/api/executors/{member_setup[4].pk}/", {"enabled": False}, format="json")
        event = AuditEvent.objects.get(action="executor.update")
        assert b"executor.update" in browser.get("/admin/telemachus/auditevent/").content
        assert browser.get(f"/admin/telemachus/auditevent/{event.pk}/change/").status_code == 200
        assert browser.get("/admin/telemachus/auditevent/add/").status_code == 403
        assert browser.post(f"/admin/telemachus/auditevent/{event.pk}/delete/", {"post": "yes"}).status_code == 403


class TestAuditApi:
    def test_filters_and_cursor_pages(self, api, operator, member_setup, make_user):
        client = api(operator)
        executor = member_setup[4]
        for limit in (5, 6, 7):
            client.patch(f"/api/executors/{executor.pk}/", {"max_concurrency": limit}, format="json")
        client.put("/api/policy/", {"default_weight": 2}, format="json")
        AuditEvent.objects.filter(action="queue_policy.update").update(at=timezone.now() - timedelta(days=2))

        page = client.get("/api/audit/", {"page_size": 2}).json()
        assert [e["action"] for e in page["results"]] == ["queue_policy.update", "executor.update"]
        rest = client.get(page["next"]).json()
        assert [e["after"] for e in rest["results"]] == [{"max_concurrency": 6}, {"max_concurrency": 5}]

        by_object = client.get("/api/audit/", {"object_type": "executor", "object_id": executor.pk}).json()["results"]
        assert len(by_object) == 3 and by_object[0]["actor"] == "operator" and by_object[0]["source"] == "api"
        assert len(client.get("/api/audit/", {"actor": "operator", "action": "queue_policy"}).json()["results"]) == 1
        assert client.get("/api/audit/", {"actor": "alice"}).json()["results"] == []
        since = (timezone.now() - timedelta(days=1)).isoformat()
        assert len(client.get("/api/audit/", {"actor": "operator", "since": since}).json()["results"]) == 3
        assert len(client.get("/api/audit/", {"actor": "operator", "until": since}).json()["results"]) == 1
        assert {e["action"] for e in client.get("/api/audit/", {"actor": "system"}).json()["results"]} == {
            "team.create",
            "team.member_add",
        }
        assert client.get("/api/audit/", {"since": "yesterday"}).json()["error"] == "validation_error"

    def test_operators_only(self, api, member_setup):
        response = api(member_setup[0]).get("/api/audit/")
        assert response.status_code == 403 and response.json()["error"] == "forbidden"
        assert api().get("/api/audit/").status_code == 401


def test_system_changes_have_no_actor(member_setup):
    from executors.services import executor_update

    executor_update(executor=member_setup[4], enabled=False)
    event = AuditEvent.objects.get(action="executor.update")
    assert (event.actor, event.actor_name, event.source) == (None, "", "system")
    assert Job.objects.count() == 0


def test_no_secret_is_written_to_the_audit_log_whoever_records_it(operator):
    """The audit's second line: a service that passes a secret under a secret's name (an API key,
    a password, an Authorization header, at any depth) has it masked; other values stay."""
    from telemachus.control.audit import audit_record

    event = audit_record(
        by=operator,
        action="thing.update",
        object_type="thing",
        object_id=1,
        before={"password": "hunter2", "max_tokens": 64, "api_key_env": "OPENAI_API_KEY"},
        after={"provider": {"apiKey": "sk-123", "headers": [{"Authorization": "Bearer sk-123"}]}, "token": True},
    )
    event.refresh_from_db()
    assert event.before == {"password": "********", "max_tokens": 64, "api_key_env": "OPENAI_API_KEY"}
    assert event.after == {
        "provider": {"apiKey": "********", "headers": [{"Authorization": "********"}]},
        "token": True,
    }
