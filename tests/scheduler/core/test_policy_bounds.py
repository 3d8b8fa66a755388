"""Operator settings are bounded (a clear 400), and whatever is stored, the claim, the submit, the
finish, recovery and the queue snapshot keep working: a bad stored value is logged once and the
last good value (or the default) is used."""

import logging

import pytest
from django.db.models import F

from scheduler.core import bounds as policy_bounds
from scheduler.core.bounds import MAPS, SCALARS, policy_in_force
from scheduler.live.snapshot import dashboard_state
from scheduler.models import Job, QueuePolicy
from scheduler.services.claim import job_claim
from scheduler.services.finish import job_finish
from scheduler.services.recover import jobs_recover
from scheduler.services.submit import job_submit
from telemachus.models import AuditEvent
from tests.processes import wait_until

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fresh_memory():
    """policy_in_force remembers the last good values of its process; each test starts without."""
    policy_bounds._last_good.clear()
    policy_bounds._reported.clear()
    yield
    policy_bounds._last_good.clear()
    policy_bounds._reported.clear()


def store(**fields) -> None:
    """Write values straight to the row, as SQL or an old release could have."""
    QueuePolicy.objects.update_or_create(pk=1, defaults={})
    QueuePolicy.objects.filter(pk=1).update(**fields)


def out_of_bounds(name: str) -> list:
    low, high, kind = SCALARS[name]
    values = [low - 1, high * 10, "many", None, True]
    if kind is int:
        values.append(low + 0.5)
    return values


SCALAR_CASES = [(name, value) for name in SCALARS for value in out_of_bounds(name)]


class TestApiBounds:
    @pytest.mark.parametrize(("field", "value"), SCALAR_CASES)
    def test_every_number_is_bounded(self, api, operator, member_setup, field, value):
        response = api(operator).put("/api/policy/", {field: value}, format="json")
        assert response.status_code == 400, response.content
        assert response.json()["error"] == "validation_error" and field in response.json()["fields"]
        assert not AuditEvent.objects.filter(action="queue_policy.update").exists()

    @pytest.mark.parametrize("field", MAPS)
    @pytest.mark.parametrize("value", [1e11, -1e11, "x", None, [1], {"n": 1}])
    def test_every_map_value_is_bounded(self, api, operator, member_setup, field, value):
        key = {"team_weights": "a", "max_queue_depth": "default", "priority_map": "member"}[field]
        response = api(operator).put("/api/policy/", {field: {key: value}}, format="json")
        assert response.status_code == 400, response.content
        assert field in response.json()["fields"]

    def test_the_issue_values_are_refused(self, api, operator, member_setup):
        for body in ({"aging_after_seconds": 1e11}, {"share_window_seconds": 1e11}):
            response = api(operator).put("/api/policy/", body, format="json")
            assert response.status_code == 400 and list(response.json()["fields"]) == list(body)
        assert QueuePolicy.objects.get().aging_after_seconds == 300

    def test_values_at_the_bounds_are_accepted(self, api, operator, member_setup):
        body = {name: (high if kind is float else int(high)) for name, (_, high, kind) in SCALARS.items()}
        response = api(operator).put("/api/policy/", body, format="json")
        assert response.status_code == 200, response.content
        assert policy_bounds.policy_problems(QueuePolicy.objects.get()) == {}

    def test_admin_form_has_the_same_bounds(self, client, operator, member_setup):
        client.force_login(operator)
        form = client.get("/admin/scheduler/queuepolicy/1/change/").context["adminform"].form
        data = {name: ("" if form.initial.get(name) is None else form.initial.get(name)) for name in form.fields}
        data.update(
            {"aging_after_seconds": "1e11", "team_weights": '{"a": -3}', "max_queue_depth": "{}", "priority_map": "{}"}
        )
        response = client.post("/admin/scheduler/queuepolicy/1/change/", data)
        assert response.status_code == 200  # the form again, with errors
        errors = response.context["adminform"].form.errors
        assert set(errors) == {"aging_after_seconds", "team_weights"}
        assert QueuePolicy.objects.get().aging_after_seconds == 300


BROKEN = {
    "aging_after_seconds": 1e11,
    "share_window_seconds": 1e11,
    "half_life_seconds": 0.0,
    "aging_step_seconds": -5.0,
    "team_weights": {"a": "heavy", "b": 1e300},
    "max_queue_depth": {"default": 10**19},
    "priority_map": {"member": "x"},
    "max_attempts": 0,
    "placement": "random",
    "cost": "gold",
    "recovery": "pray",
}


class TestStoredValues:
    def test_the_scheduler_runs_on_whatever_is_stored(self, member_setup, api, caplog):
        # Given every setting broken in the row itself...
        alice = member_setup[0]
        store(**BROKEN)
        caplog.set_level(logging.ERROR, logger="telemachus.policy")

        # When jobs are submitted, claimed, finished, recovered, and the queue is looked at...
        for _ in range(3):
            job_submit(
                user=alice,
                team="a",
                type="chat",
                requirements={"model": "m"},
                input={"messages": [{"role": "user", "content": "hi"}]},
            )
        claims = job_claim(worker="w", limit=3).claims
        assert len(claims) == 3
        assert job_finish(job_id=claims[0].job.pk, lease=claims[0].lease, result={"ok": True})
        Job.objects.filter(pk=claims[1].job.pk).update(lease_expires_at=F("started_at"))
        assert jobs_recover().requeued == [claims[1].job.pk]
        assert api(alice).get("/api/queue/").status_code == 200
        assert api(alice).get("/api/policy/").status_code == 200
        assert dashboard_state(user=alice)["queue"]["teams"][0]["team"] == "a"

        # Then everything worked on defaults, and each bad value was logged once.
        assert sorted(Job.objects.values_list("status", flat=True)) == ["done", "queued", "running"]
        logged = [r.getMessage() for r in caplog.records if r.name == "telemachus.policy"]
        assert len(logged) == len(BROKEN), logged
        assert any("aging_after_seconds" in line and "100000000000" in line for line in logged)

    def test_the_last_good_value_is_kept(self):
        # Given a good policy the process has seen...
        store(aging_after_seconds=42.0, team_weights={"a": 2.0})
        assert policy_in_force(QueuePolicy.objects.get()).aging_after_seconds == 42.0
        # When the row goes bad behind the API's back...
        store(aging_after_seconds=1e11, team_weights={"a": -1})
        in_force = policy_in_force(QueuePolicy.objects.get())
        # Then the last good values stay in force; the row itself is left for an operator to fix.
        assert in_force.aging_after_seconds == 42.0 and in_force.team_weights == {"a": 2.0}
        assert QueuePolicy.objects.get().aging_after_seconds == 1e11

    def test_without_a_good_value_the_default_is_used(self):
        store(share_window_seconds=1e11)
        assert policy_in_force(QueuePolicy.objects.get()).share_window_seconds == 300.0

    def test_an_operator_can_repair_a_broken_row(self, api, operator, member_setup):
        store(aging_after_seconds=1e11)
        response = api(operator).put("/api/policy/", {"aging_after_seconds": 60}, format="json")
        assert response.status_code == 200
        assert QueuePolicy.objects.get().aging_after_seconds == 60
        assert AuditEvent.objects.get(action="queue_policy.update").before == {"aging_after_seconds": 1e11}


class TestWhatMembersSee:
    def test_no_other_team_or_user_leaks(self, api, operator, member_setup, make_user):
        # Given a policy naming both teams and both users...
        body = {
            "team_weights": {"a": 2, "b": 5},
            "max_queue_depth": {"default": 100, "a": 10, "b": 20},
            "priority_map": {"member": 1, "manager": 5, "team:a": 3, "team:b": 4, "user:alice": 2, "user:bob": 9},
        }
        assert api(operator).put("/api/policy/", body, format="json").status_code == 200

        # When alice (team a) reads it...
        seen = api(member_setup[0]).get("/api/policy/").json()

        # Then she sees her team, herself and the roles, nothing of b or bob.
        assert seen["team_weights"] == {"a": 2.0}
        assert seen["max_queue_depth"] == {"default": 100, "a": 10}
        assert seen["priority_map"] == {"member": 1, "manager": 5, "team:a": 3, "user:alice": 2}
        assert api(operator).get("/api/policy/").json()["team_weights"] == {"a": 2.0, "b": 5.0}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_process_keeps_working_on_a_broken_row(processes, member_setup):
    # Given the issue's values stored in the row (every worker used to exit at its first claim)...
    store(aging_after_seconds=1e11, share_window_seconds=1e11, team_weights={"a": "x"})
    alice = member_setup[0]
    worker = processes.worker("w", concurrency=2)

    # When jobs are submitted...
    for _ in range(3):
        job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )

    # Then they are done, and the worker is still running and said why it ignored the row.
    wait_until(lambda: Job.objects.filter(status="done").count() == 3, timeout=60, what="3 jobs done")
    assert worker.poll() is None
    log = worker.log_path.read_text()
    assert "queue policy: stored aging_after_seconds" in log and "Traceback" not in log
