"""The queue policy: fair share, weight 0, priority, aging, the priority map, the depth cap,
placement, a custom policy from the setting, and operator edits through the API."""

import html
import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from quotas.models import QuotaPolicy
from scheduler.core.policy import FairSharePolicy, policy_for
from scheduler.models import Job, JobEvent, QueuePolicy, Slot, TeamShare
from scheduler.services.claim import job_claim
from scheduler.services.finish import job_finish
from scheduler.services.policy import EDITABLE
from scheduler.services.submit import job_submit
from telemachus.errors import TryLater
from telemachus.models import AuditEvent
from tests.conftest import backdate, chat_body

pytestmark = pytest.mark.django_db


def policy(**fields) -> QueuePolicy:
    record, _ = QueuePolicy.objects.update_or_create(pk=1, defaults=fields)
    return record


def submit(user, team, priority=0, **requirements):
    return job_submit(
        user=user,
        team=team,
        type="chat",
        priority=priority,
        requirements={"model": "m", **requirements},
        input={"messages": []},
    )


def claim_order(n: int) -> list[int]:
    """Claim one job at a time (as a cap of one slot would), finishing each at once."""
    order = []
    for _ in range(n):
        batch = job_claim(worker="w", limit=1).claims
        if not batch:
            break
        (claim,) = batch
        order.append(claim.job.pk)
        job_finish(job_id=claim.job.pk, lease=claim.lease, result={})
    return order


@pytest.fixture
def three_teams(make_user, make_team, make_executor):
    users = {name: make_user(name) for name in ("u1", "u2", "u3")}
    for i, name in enumerate(users, start=1):
        make_team(f"t{i}", {users[name]: "member"})
    make_executor("shared", models=["m"], max_concurrency=100)
    return users


class TestFairShare:
    def test_a_team_with_one_job_goes_before_a_team_with_a_thousand(self, three_teams):
        u1, u2, _ = three_teams.values()
        team_id = submit(u1, "t1").team_id
        Job.objects.bulk_create(
            [Job(type="chat", user=u1, team_id=team_id, model="m", requirements={"model": "m"}) for _ in range(999)]
        )
        job_claim(worker="w", limit=3)  # team t1 now runs three jobs
        lone = submit(u2, "t2")
        assert [c.job.pk for c in job_claim(worker="w", limit=1).claims] == [lone.pk]

    def test_running_slots_are_shared_by_weight(self, three_teams):
        u1, u2, u3 = three_teams.values()
        policy(team_weights={"t1": 1, "t2": 2, "t3": 3}, entry_penalty=0)
        for user, team in ((u1, "t1"), (u2, "t2"), (u3, "t3")):
            for _ in range(20):
                submit(user, team)
        claims = job_claim(worker="w", limit=12).claims
        per_team = {slug: sum(1 for c in claims if c.job.team.slug == slug) for slug in ("t1", "t2", "t3")}
        assert per_team == {"t1": 2, "t2": 4, "t3": 6}

    def test_past_usage_decays_and_counts(self, three_teams):
        u1, u2, _ = three_teams.values()
        policy(half_life_seconds=60, entry_penalty=0)
        now = timezone.now()
        t1_heavy = TeamShare.objects.create(team_id=submit(u1, "t1").team_id, usage=6000, updated_at=now)
        t2_job = submit(u2, "t2")
        assert [c.job.pk for c in job_claim(worker="w", limit=1).claims] == [t2_job.pk]
        assert t1_heavy.decayed(now + timedelta(seconds=60), 60) == pytest.approx(3000)

    def test_entry_penalty_is_held_until_the_real_cost_is_known(self, three_teams):
        u1 = three_teams["u1"]
        policy(entry_penalty=2.5)
        job = submit(u1, "t1")
        (claim,) = job_claim(worker="w", limit=1).claims
        share = TeamShare.objects.get(team_id=job.team_id)
        assert share.usage == pytest.approx(2.5)
        Slot.objects.filter(job=job).update(acquired_at=timezone.now() - timedelta(seconds=4))
        job_finish(job_id=job.pk, lease=claim.lease, result={})
        share.refresh_from_db()
        assert share.usage == pytest.approx(4.0, abs=0.2), "history keeps the 4 slot-seconds, not the penalty"

    def test_an_idle_team_catches_up_only_to_its_share(self, three_teams):
        u1, u2, _ = three_teams.values()
        policy(entry_penalty=0)
        # t1 has a long history; t2 none. With 12 slots and equal weights, t2's share is 6 (+1).
        TeamShare.objects.create(team_id=submit(u1, "t1").team_id, usage=1e6, updated_at=timezone.now())
        QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=12)
        for _ in range(30):
            submit(u1, "t1")
            submit(u2, "t2")
        claims = job_claim(worker="w", limit=12).claims
        per_team = {slug: sum(1 for c in claims if c.job.team.slug == slug) for slug in ("t1", "t2")}
        assert per_team == {"t1": 5, "t2": 7}

    def test_weight_zero_only_takes_spare_capacity(self, three_teams):
        u1, u2, _ = three_teams.values()
        policy(team_weights={"t1": 0})
        spare = [submit(u1, "t1", priority=50) for _ in range(2)]
        wanted = [submit(u2, "t2") for _ in range(2)]
        assert claim_order(4) == [wanted[0].pk, wanted[1].pk, spare[0].pk, spare[1].pk]

    def test_priority_before_share(self, three_teams):
        u1, u2, _ = three_teams.values()
        job_claim(worker="w", limit=0)
        busy = [submit(u1, "t1") for _ in range(3)]
        job_claim(worker="w", limit=3)
        urgent = submit(u1, "t1", priority=10)
        normal = submit(u2, "t2")
        assert [c.job.pk for c in job_claim(worker="w", limit=1).claims] == [urgent.pk]
        assert [c.job.pk for c in job_claim(worker="w", limit=1).claims] == [normal.pk]
        assert busy

    def test_aging_lifts_an_old_low_priority_job(self, three_teams):
        u1, u2, _ = three_teams.values()
        policy(aging_after_seconds=60, aging_step_seconds=10, aging_max_boost=5)
        old = submit(u1, "t1", priority=-3)
        backdate(old.pk, timedelta(seconds=120))
        fresh = submit(u2, "t2", priority=1)
        # waited 60 s past the threshold: +5 (capped) -> 2 > 1
        assert claim_order(2) == [old.pk, fresh.pk]

    def test_aging_is_bounded(self, three_teams):
        u1, u2, _ = three_teams.values()
        policy(aging_after_seconds=0, aging_step_seconds=1, aging_max_boost=2)
        old = submit(u1, "t1", priority=-10)
        backdate(old.pk, timedelta(hours=1))
        fresh = submit(u2, "t2", priority=0)
        assert claim_order(2) == [fresh.pk, old.pk]

    def test_aging_reaches_an_old_job_behind_newer_high_priority_ones_of_its_team(self, three_teams):
        u1 = three_teams["u1"]
        policy(aging_after_seconds=0, aging_step_seconds=1, aging_max_boost=100)
        old = submit(u1, "t1", priority=-50)
        backdate(old.pk, timedelta(hours=1))
        for _ in range(5):
            submit(u1, "t1", priority=10)
        assert claim_order(1) == [old.pk]

    def test_aging_reaches_an_old_job_while_newer_ones_have_not_aged(self, three_teams):
        u1 = three_teams["u1"]
        policy(aging_after_seconds=60, aging_step_seconds=1, aging_max_boost=100)
        old = submit(u1, "t1", priority=-50)
        backdate(old.pk, timedelta(seconds=120))
        for _ in range(5):
            submit(u1, "t1", priority=10)
        # waited 60 s past the threshold at a level a second: -50 + 61 = 11 > 10
        assert claim_order(1) == [old.pk]

    def test_tokens_cost(self, three_teams):
        u1, u2, _ = three_teams.values()
        policy(cost="tokens", entry_penalty=0)
        big = [submit(u1, "t1", est_tokens=1000) for _ in range(2)]
        small = [submit(u2, "t2", est_tokens=10) for _ in range(3)]
        order = [c.job.pk for c in job_claim(worker="w", limit=4).claims]
        assert order[:1] == [small[0].pk] and big[0].pk in order and big[1].pk not in order


class TestAdmission:
    def test_depth_cap_says_try_later_with_retry_after(self, api, member_setup):
        alice = member_setup[0]
        policy(max_queue_depth={"default": 100, "a": 2})
        client = api(alice)
        assert client.post("/api/jobs/", chat_body("a"), format="json").status_code == 201
        assert client.post("/api/jobs/", chat_body("a"), format="json").status_code == 201
        response = client.post("/api/jobs/", chat_body("a"), format="json")
        assert response.status_code == 429
        assert response.json()["error"] == "try_later"
        assert response["Retry-After"] == str(response.json()["retry_after"]) == "60"
        assert Job.objects.count() == 2

    def test_retry_after_follows_the_drain_rate(self, member_setup):
        alice = member_setup[0]
        policy(max_queue_depth={"a": 1})
        for _ in range(30):
            done = submit(alice, "a")
            Job.objects.filter(pk=done.pk).update(status="done", finished_at=timezone.now())
        submit(alice, "a")
        with pytest.raises(TryLater) as caught:
            submit(alice, "a")
        assert caught.value.retry_after == 10  # 30 drained in 5 minutes: 0.1/s, one job over

    def test_other_teams_are_not_limited(self, member_setup):
        policy(max_queue_depth={"a": 0})
        with pytest.raises(TryLater):
            submit(member_setup[0], "a")  # the depth cap binds where it applies
        job = submit(member_setup[1], "b")
        assert job.status == Job.Status.QUEUED and job.team.slug == "b"

    def test_priority_is_clamped_with_the_reason_in_an_event(self, member_setup):
        alice = member_setup[0]
        policy(priority_map={"member": 5})
        job = submit(alice, "a", priority=50)
        assert job.priority == 5
        event = JobEvent.objects.get(job=job, event="priority_clamped")
        assert event.meta == {"requested": 50, "allowed": 5, "reason": "priority_map['member']"}

    def test_most_specific_priority_entry_wins(self, member_setup):
        alice = member_setup[0]
        policy(priority_map={"member": 0, "team:a": 20, "user:alice": 7})
        assert submit(alice, "a", priority=10).priority == 7

    def test_priority_over_the_limit_can_be_refused(self, api, member_setup):
        policy(priority_map={"member": 0}, priority_over_limit="reject")
        response = api(member_setup[0]).post("/api/jobs/", chat_body("a", priority=9), format="json")
        assert response.status_code == 400 and "priority" in response.json()["fields"]
        assert not Job.objects.exists()

    def test_without_a_map_entry_a_member_gets_the_default_ceiling(self, member_setup, settings):
        settings.TELEMACHUS_PRIORITY_CEILING = 10
        job = submit(member_setup[0], "a", priority=100)
        assert job.priority == 10
        event = JobEvent.objects.get(job=job, event="priority_clamped")
        assert event.meta == {"requested": 100, "allowed": 10, "reason": "TELEMACHUS_PRIORITY_CEILING"}
        policy(priority_map={"member": 100})
        assert submit(member_setup[0], "a", priority=100).priority == 100

    def test_operators_are_not_limited(self, operator, member_setup):
        policy(priority_map={"member": 0, "manager": 0})
        assert submit(operator, "a", priority=90).priority == 90


class TestPlacement:
    # Four jobs onto two executors (name: max_concurrency, weight), so each rule's answer differs
    # from the others' in at least one of the set-ups.
    UNEQUAL = {"small": (2, 1), "big": (6, 3)}
    EQUAL_CAPACITY = {"light": (4, 1), "heavy": (4, 3)}

    @pytest.mark.parametrize(
        ("executors", "rule", "expected"),
        [
            (UNEQUAL, "least-loaded", {"small": 1, "big": 3}),
            (UNEQUAL, "pack", {"small": 2, "big": 2}),  # fills the fullest executor first
            (UNEQUAL, "weighted", {"small": 1, "big": 3}),
            (EQUAL_CAPACITY, "least-loaded", {"light": 2, "heavy": 2}),  # same load, whatever the weight
            (EQUAL_CAPACITY, "pack", {"light": 0, "heavy": 4}),
            (EQUAL_CAPACITY, "weighted", {"light": 1, "heavy": 3}),  # spread 1:3 by weight
        ],
    )
    def test_rules(self, member_setup, make_executor, executors, rule, expected):
        alice, _, _, _, shared = member_setup
        shared.delete()
        for name, (max_concurrency, weight) in executors.items():
            make_executor(name, models=["m"], max_concurrency=max_concurrency, weight=weight)
        policy(placement=rule)
        for _ in range(4):
            submit(alice, "a")
        placed = [c.executor.name for c in job_claim(worker="w", limit=4).claims]
        assert {name: placed.count(name) for name in executors} == expected


class TestCustomPolicy:
    def test_loaded_from_the_setting(self, settings, three_teams):
        settings.TELEMACHUS_QUEUE_POLICY = "docs.examples.business_hours.BusinessHoursPolicy"
        from docs.examples.business_hours import BusinessHoursPolicy

        assert isinstance(policy_for(QueuePolicy()), BusinessHoursPolicy)

    def test_business_hours_put_support_first(self, settings, make_user, make_team, make_executor, monkeypatch):
        from docs.examples.business_hours import BusinessHoursPolicy

        settings.TELEMACHUS_QUEUE_POLICY = "docs.examples.business_hours.BusinessHoursPolicy"
        ops, helper = make_user("ops"), make_user("helper")
        make_team("ops", {ops: "member"})
        make_team("support", {helper: "member"})
        make_executor("shared", models=["m"])
        first = [submit(ops, "ops") for _ in range(3)]
        tickets = [submit(helper, "support") for _ in range(2)]
        monkeypatch.setattr(BusinessHoursPolicy, "in_business_hours", lambda self, now: True)
        assert claim_order(5)[:2] == [tickets[0].pk, tickets[1].pk]
        assert first

    def test_outside_business_hours_it_is_fair_share(self):
        tuesday_night = datetime(2026, 12, 1, 23, 0, tzinfo=UTC)
        from docs.examples.business_hours import BusinessHoursPolicy

        assert not BusinessHoursPolicy(QueuePolicy()).in_business_hours(tuesday_night)
        assert isinstance(BusinessHoursPolicy(QueuePolicy()), FairSharePolicy)


class TestPolicyApi:
    def test_read_and_edit_with_an_audit_event(self, api, operator, member_setup):
        client = api(operator)
        assert client.get("/api/policy/").json()["placement"] == "least-loaded"
        response = client.put("/api/policy/", {"team_weights": {"a": 3}, "placement": "pack"}, format="json")
        assert response.status_code == 200
        assert response.json()["team_weights"] == {"a": 3.0} and response.json()["placement"] == "pack"
        event = AuditEvent.objects.get(action="queue_policy.update")
        assert (event.actor_name, event.source) == ("operator", "api")
        assert event.before == {"team_weights": {}, "placement": "least-loaded"}
        assert event.after == {"team_weights": {"a": 3.0}, "placement": "pack"}
        assert QueuePolicy.objects.get().placement == "pack"

    def test_members_read_but_cannot_edit(self, api, member_setup):
        client = api(member_setup[0])
        assert client.get("/api/policy/").status_code == 200
        assert client.put("/api/policy/", {"placement": "pack"}, format="json").status_code == 403

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"team_weights": {"nope": 1}}, "team_weights"),
            ({"team_weights": {"a": -1}}, "team_weights"),
            ({"max_queue_depth": {"a": -5}}, "max_queue_depth"),
            ({"priority_map": {"wizard": 3}}, "priority_map"),
            ({"priority_map": {"user:nobody": 3}}, "priority_map"),
            ({"priority_map": {"member": 500}}, "priority_map"),
            ({"placement": "random"}, "placement"),
            ({"half_life_seconds": 0}, "half_life_seconds"),
            ({"policy_class": "os.path.join"}, "policy_class"),
            ({"policy_class": "no.such.Policy"}, "policy_class"),
            ({"recovery": "retry"}, "recovery"),
            ({"lease": 1}, "lease"),
        ],
    )
    def test_bad_input(self, api, operator, member_setup, body, field):
        response = api(operator).put("/api/policy/", body, format="json")
        assert response.status_code == 400 and field in response.json()["fields"]
        assert not AuditEvent.objects.filter(action="queue_policy.update").exists()

    def test_every_setting_says_what_it_does_in_the_admin_and_on_the_dashboard(self, client, operator):
        """Each editable field has its help text (the model's), shown under it in the admin and
        handed to the dashboard's policy editor with the page."""
        helps = {name: str(QueuePolicy._meta.get_field(name).help_text) for name in EDITABLE}
        assert all(len(text) > 20 for text in helps.values()), [name for name, text in helps.items() if len(text) <= 20]
        client.force_login(operator)
        admin_page = client.get("/admin/scheduler/queuepolicy/1/change/").content.decode()
        dashboard = client.get("/dashboard/").content.decode()
        handed = json.loads(html.unescape(re.search(r'<table id="policy" data-help="([^"]*)"', dashboard)[1]))
        assert handed == helps
        for name, text in helps.items():
            # The admin writes help text as HTML, unescaped: markup in it would vanish from the page.
            assert "<" not in text and "&" not in text, name
            shown = re.search(rf'<div class="help" id="id_{name}_helptext">\s*<div>(.*?)</div>', admin_page, re.S)
            assert shown is not None and html.unescape(shown[1]) == text, name

    def test_admin_edits_are_audited_too(self, client, operator, member_setup):
        client.force_login(operator)
        page = client.get("/admin/scheduler/queuepolicy/1/change/")
        assert page.status_code == 200
        form = page.context["adminform"].form
        data = {name: form.initial.get(name) for name in form.fields}
        data.update(
            {"placement": "weighted", "team_weights": '{"b": 2}', "max_queue_depth": "{}", "priority_map": "{}"}
        )
        data = {k: ("" if v is None else v) for k, v in data.items()}
        response = client.post("/admin/scheduler/queuepolicy/1/change/", data)
        assert response.status_code == 302, response.content[:3000]
        event = AuditEvent.objects.get(action="queue_policy.update")
        assert (event.actor_name, event.source) == ("operator", "admin") and event.after["placement"] == "weighted"
