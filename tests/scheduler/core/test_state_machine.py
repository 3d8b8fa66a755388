"""A Hypothesis state machine over the job lifecycle services: submit, claim, finish (ok, failed,
retryable, stale), cancel, requeue, release, leases expiring and recovery, in any order.

After every step: each job is in exactly the state its transitions say; a job is running exactly
when it has a lease and one slot; slots at every scope stay within their caps; no job has two
`finished` events and its latest lifecycle event matches its status; a stale lease never writes."""

import uuid

import pytest
from django.contrib.auth import get_user_model
from django.db.models import Count
from django.db.models.functions import Now
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from executors.models import Executor
from quotas.models import QuotaPolicy, Usage
from scheduler.models import Job, JobEvent, QueuePolicy, Slot, TeamShare
from scheduler.services.cancel import job_cancel
from scheduler.services.claim import job_claim
from scheduler.services.finish import Outcome, jobs_finish
from scheduler.services.lease import jobs_release
from scheduler.services.recover import jobs_recover
from scheduler.services.requeue import job_requeue
from scheduler.services.submit import job_submit
from telemachus.errors import Conflict
from telemachus.models import Team

CAPS = {"global": 3, "team:a": 2}
EXECUTOR_LIMITS = {"e1": 2, "e2": 1}
MAX_ATTEMPTS = 3
# The status each lifecycle event leaves a job in.
EVENT_STATUS = {
    "queued": "queued",
    "requeued": "queued",
    "retry_scheduled": "queued",
    "started": "running",
    "finished": "done",
    "failed": "failed",
    "canceled": "canceled",
}


class Lifecycle(RuleBasedStateMachine):
    """`self.expected` is the model: job id -> status; `self.leases` the leases workers hold."""

    @initialize()
    def fresh(self) -> None:
        for model in (JobEvent, Slot, Job, Usage, TeamShare):
            model.objects.all().delete()
        self.users = {u.username: u for u in get_user_model().objects.all()}
        self.expected: dict[int, str] = {}
        self.leases: dict[int, uuid.UUID] = {}
        self.stale: dict[int, uuid.UUID] = {}

    def jobs_in(self, *statuses: str) -> list[int]:
        return sorted(j for j, s in self.expected.items() if s in statuses)

    # --- transitions ---------------------------------------------------------------------------

    @rule(who=st.sampled_from([("alice", "a"), ("bob", "b"), ("carol", "a")]), priority=st.integers(-2, 2))
    def submit(self, who: tuple[str, str], priority: int) -> None:
        username, team = who
        job = job_submit(
            user=self.users[username],
            team=team,
            type="chat",
            priority=priority,
            requirements={"model": "m", "est_tokens": 5},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )
        self.expected[job.pk] = "queued"

    @rule(limit=st.integers(1, 4))
    def claim(self, limit: int) -> None:
        claimed = job_claim(worker="w", limit=limit).claims
        for c in claimed:
            assert self.expected[c.job.pk] == "queued", f"claimed job {c.job.pk} was {self.expected[c.job.pk]}"
            self.expected[c.job.pk] = "running"
            self.leases[c.job.pk] = c.lease

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), how=st.sampled_from(["done", "failed", "retry"]))
    def finish(self, data: st.DataObject, how: str) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.leases)))
        lease = self.leases.pop(job_id)
        outcome = Outcome(
            job_id=job_id,
            lease=lease,
            ok=how == "done",
            result={"ok": True} if how == "done" else None,
            error="" if how == "done" else "boom",
            retryable=how == "retry",
            tokens_used=3,
        )
        report = jobs_finish(outcomes=[outcome])
        assert report.refused == [], report
        attempts = Job.objects.get(pk=job_id).attempts
        if how == "retry" and job_id in report.retrying:
            assert attempts < MAX_ATTEMPTS
            self.expected[job_id] = "queued"
        else:
            assert report.accepted == [job_id]
            self.expected[job_id] = "done" if how == "done" else "failed"
        self.stale[job_id] = lease

    @precondition(lambda self: self.stale)
    @rule(data=st.data())
    def finish_with_a_stale_lease(self, data: st.DataObject) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.stale)))
        before = Job.objects.filter(pk=job_id).values("status", "lease", "result").get()
        report = jobs_finish(outcomes=[Outcome(job_id=job_id, lease=self.stale[job_id], ok=True, result={"x": 1})])
        assert report.refused == [job_id] and report.accepted == []
        assert Job.objects.filter(pk=job_id).values("status", "lease", "result").get() == before

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.expected)))
        if self.expected[job_id] in Job.TERMINAL:
            with pytest.raises(Conflict):
                job_cancel(job_id=job_id, by=self.users["operator"])
            return
        job_cancel(job_id=job_id, by=self.users["operator"])
        self.expected[job_id] = "canceled"
        if job_id in self.leases:
            self.stale[job_id] = self.leases.pop(job_id)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.expected)))
        if self.expected[job_id] not in ("failed", "canceled"):
            with pytest.raises(Conflict):
                job_requeue(job_id=job_id, by=self.users["operator"])
            return
        job_requeue(job_id=job_id, by=self.users["operator"])
        self.expected[job_id] = "queued"

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """A worker shutting down gives a job back."""
        job_id = data.draw(st.sampled_from(sorted(self.leases)))
        assert jobs_release(held={job_id: self.leases[job_id]}, reason="shutdown") == [job_id]
        self.stale[job_id] = self.leases.pop(job_id)
        self.expected[job_id] = "queued"

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def worker_dies(self, data: st.DataObject) -> None:
        """Its lease runs out (no more heartbeats); recovery has not run yet."""
        job_id = data.draw(st.sampled_from(sorted(self.leases)))
        Job.objects.filter(pk=job_id).update(lease_expires_at=Now())
        self.stale[job_id] = self.leases.pop(job_id)

    @rule()
    def recover(self) -> None:
        report = jobs_recover()
        for job_id in report.requeued:
            assert self.expected[job_id] == "running" and job_id not in self.leases
            self.expected[job_id] = "queued"
        for job_id in report.failed:
            assert self.expected[job_id] == "running" and job_id not in self.leases
            self.expected[job_id] = "failed"

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def rows_match_the_model(self) -> None:
        rows = {pk: (status, lease) for pk, status, lease in Job.objects.values_list("pk", "status", "lease")}
        assert {pk: status for pk, (status, _) in rows.items()} == self.expected
        slots = dict(Slot.objects.values_list("job").annotate(n=Count("id")))
        for pk, (status, lease) in rows.items():
            running = status == "running"
            assert (lease is not None) == running, f"job {pk} is {status} with lease {lease}"
            assert slots.get(pk, 0) == (1 if running else 0), f"job {pk} is {status} with {slots.get(pk, 0)} slots"

    @invariant()
    def no_cap_exceeded(self) -> None:
        assert Slot.objects.count() <= CAPS["global"]
        assert Slot.objects.filter(team__slug="a").count() <= CAPS["team:a"]
        for name, limit in EXECUTOR_LIMITS.items():
            assert Slot.objects.filter(executor__name=name).count() <= limit

    @invariant()
    def events_tell_the_same_story(self) -> None:
        latest: dict[int, str] = {}
        finished: dict[int, int] = {}
        for job_id, event in (
            JobEvent.objects.filter(job__isnull=False, event__in=EVENT_STATUS)
            .order_by("id")
            .values_list("job_id", "event")
        ):
            latest[job_id] = event
            finished[job_id] = finished.get(job_id, 0) + (event == "finished")
        for job_id, status in self.expected.items():
            assert EVENT_STATUS[latest[job_id]] == status, f"job {job_id} is {status}, last event {latest[job_id]}"
            assert finished.get(job_id, 0) <= 1


@pytest.mark.django_db
def test_the_lifecycle_keeps_its_invariants(make_user, make_team, make_executor):
    alice, bob, carol = make_user("alice"), make_user("bob"), make_user("carol")
    make_user("operator", is_superuser=True)
    make_team("a", {alice: "member", carol: "member"})
    make_team("b", {bob: "member"})
    for name, limit in EXECUTOR_LIMITS.items():
        make_executor(name, models=["m"], max_concurrency=limit)
    QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=CAPS["global"])
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=CAPS["team:a"])
    QueuePolicy.objects.update_or_create(pk=1, defaults={"max_attempts": MAX_ATTEMPTS})
    assert Team.objects.count() == 2 and Executor.objects.count() == 2
    run_state_machine_as_test(
        Lifecycle,
        settings=settings(
            max_examples=50,
            stateful_step_count=50,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
