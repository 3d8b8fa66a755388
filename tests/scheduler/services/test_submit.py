"""Submit at the speed of the API: a few statements per job, configuration read once per version
and never trusted past a change, and bulk submits that are all or nothing."""

import psycopg
import pytest
from django.db import connection
from django.utils import timezone
from guardian.shortcuts import remove_perm

from executors.models import Executor
from quotas.budget import admission_budgets
from quotas.models import QuotaPolicy
from scheduler.core.configuration import configuration
from scheduler.models import Job, JobEvent, QueuePolicy
from scheduler.services.submit import MAX_BULK, JobSpec, job_submit, jobs_submit
from telemachus.control import notify as signals
from telemachus.control.config import config_snapshot
from telemachus.errors import Forbidden, QuotaExceeded, TryLater, UnknownModel, ValidationFailed
from telemachus.models import ApiKey, Team
from telemachus.teams.services import team_member_remove

pytestmark = pytest.mark.django_db


def spec(team="a", model="m", priority=0, est=10) -> JobSpec:
    return JobSpec(
        team=team,
        type="chat",
        priority=priority,
        requirements={"model": model, "est_tokens": est},
        # A request that can cost no more than the estimate (5 + 1 tokens), so the estimate stands.
        input={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    )


def one(user, **kwargs) -> Job:
    s = spec(**kwargs)
    return job_submit(
        user=user, team=s.team, type=s.type, requirements=s.requirements, input=s.input, priority=s.priority
    )


# SQLite: BEGIN, the guard (the team's queue and the version), the job insert, the event insert,
# COMMIT.
ROUND_TRIPS = 5


def at_once() -> int:
    """PostgreSQL writes a job in one statement that commits by itself."""
    return 1 if connection.vendor == "postgresql" else ROUND_TRIPS


@pytest.mark.django_db(transaction=True)
class TestRoundTrips:
    def test_a_submit_with_configuration_unchanged(self, member_setup, django_assert_num_queries):
        # Given a process that has submitted before (so it holds the configuration)...
        alice = member_setup[0]
        one(alice)

        # Then the next submit runs only what must be live: one statement on PostgreSQL, five on
        # SQLite.
        with django_assert_num_queries(at_once()):
            one(alice)

    def test_with_a_budget_in_force(self, member_setup, django_assert_num_queries):
        alice = member_setup[0]
        QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=10_000, window="day")
        one(alice)
        # The ledger's read, then the submit's statement.
        with django_assert_num_queries(1 + at_once()):
            one(alice)

    def test_rules_that_count_no_submit_read_no_ledger(self, member_setup, django_assert_num_queries):
        # Given a concurrency cap and an executor's budget: neither is checked at submit
        # (Configuration.admission_rules), so the submit stays one statement on PostgreSQL.
        alice, executor = member_setup[0], member_setup[4]
        QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=5)
        QuotaPolicy.objects.create(
            scope="executor", subject=executor.name, dimension="ai.tokens", limit=10, window="day"
        )
        one(alice)
        with django_assert_num_queries(at_once()):
            one(alice)

    def test_a_bulk_submit_costs_what_one_does(self, member_setup, django_assert_max_num_queries):
        alice = member_setup[0]
        one(alice)
        # SQLite caps the parameters of one statement (999), so its job inserts go in batches (a
        # batch per 999 // columns jobs: four batches of a hundred jobs' 40-odd columns).
        with django_assert_max_num_queries(at_once() if connection.vendor == "postgresql" else ROUND_TRIPS + 4):
            assert len(jobs_submit(user=alice, jobs=[spec() for _ in range(100)])) == 100


class TestConfigurationChanges:
    """Each change lands between two submits of a process that holds the configuration."""

    def test_an_executor_disabled(self, member_setup):
        alice, executor = member_setup[0], member_setup[4]
        one(alice)
        Executor.objects.filter(pk=executor.pk).update(enabled=False)
        with pytest.raises(UnknownModel):
            one(alice)

    def test_an_executor_added(self, member_setup, make_executor):
        alice = member_setup[0]
        one(alice)
        make_executor("llama-box", models=["llama"])
        assert one(alice, model="llama").model == "llama"

    def test_a_member_removed(self, member_setup):
        alice, _, team_a, _, _ = member_setup
        one(alice)
        team_member_remove(team=team_a, user=alice)
        with pytest.raises(ValidationFailed):
            one(alice)

    def test_a_permission_withdrawn(self, member_setup):
        alice, _, team_a, _, _ = member_setup
        one(alice)
        remove_perm("telemachus.use_chat", team_a.group, team_a)
        with pytest.raises(Forbidden):
            one(alice)

    def test_the_priority_map_tightened(self, member_setup):
        alice = member_setup[0]
        assert one(alice, priority=8).priority == 8
        QueuePolicy.objects.update_or_create(pk=1, defaults={"priority_map": {"member": 5}})
        assert one(alice, priority=8).priority == 5


class TestBulk:
    def test_all_are_queued_in_order_with_their_events(self, member_setup):
        alice, bob, *_ = member_setup
        jobs = jobs_submit(user=alice, jobs=[spec(), spec(priority=3), spec()])
        assert [job.status for job in jobs] == ["queued"] * 3
        assert [job.pk for job in jobs] == sorted(job.pk for job in jobs)
        assert JobEvent.objects.filter(job__in=jobs, event="queued").count() == 3

    def test_one_refusal_writes_nothing_and_names_the_job(self, member_setup):
        alice = member_setup[0]
        with pytest.raises(UnknownModel) as refused:
            jobs_submit(user=alice, jobs=[spec(), spec(), spec(model="nope"), spec()])
        assert refused.value.extra["index"] == 2
        assert not Job.objects.exists() and not JobEvent.objects.exists()

    def test_a_team_not_joined(self, member_setup):
        alice = member_setup[0]
        with pytest.raises(ValidationFailed) as refused:
            jobs_submit(user=alice, jobs=[spec(), spec(team="b")])
        assert refused.value.extra["index"] == 1
        assert not Job.objects.exists()

    def test_the_depth_cap_counts_the_whole_batch(self, member_setup):
        # Given team a with 3 jobs queued and a depth cap of 5...
        alice = member_setup[0]
        QueuePolicy.objects.update_or_create(pk=1, defaults={"max_queue_depth": {"a": 5}})
        for _ in range(3):
            one(alice)

        # A batch of 3 would make 6: refused at its third job, and nothing of it written.
        with pytest.raises(TryLater) as refused:
            jobs_submit(user=alice, jobs=[spec(), spec(), spec()])
        assert refused.value.extra["index"] == 2
        assert Job.objects.count() == 3
        # A batch of 2 fits.
        assert len(jobs_submit(user=alice, jobs=[spec(), spec()])) == 2

    def test_teams_are_counted_apart(self, member_setup, make_team):
        alice = member_setup[0]
        make_team("c", {alice: "member"})
        QueuePolicy.objects.update_or_create(pk=1, defaults={"max_queue_depth": {"default": 2}})
        jobs = jobs_submit(user=alice, jobs=[spec(team="a"), spec(team="c"), spec(team="a"), spec(team="c")])
        assert len(jobs) == 4

    def test_each_job_against_the_budget(self, member_setup):
        alice = member_setup[0]
        QuotaPolicy.objects.create(scope="user", subject="alice", dimension="ai.tokens", limit=100, window="day")
        with pytest.raises(QuotaExceeded) as refused:
            jobs_submit(user=alice, jobs=[spec(est=50), spec(est=500)])
        assert refused.value.extra["index"] == 1

    def test_priorities_are_clamped_per_job(self, member_setup):
        alice = member_setup[0]
        QueuePolicy.objects.update_or_create(pk=1, defaults={"priority_map": {"member": 2}})
        jobs = jobs_submit(user=alice, jobs=[spec(priority=1), spec(priority=9)])
        assert [job.priority for job in jobs] == [1, 2]
        assert JobEvent.objects.get(event="priority_clamped").job_id == jobs[1].pk

    @pytest.mark.parametrize("n", [0, MAX_BULK + 1])
    def test_size_bounds(self, member_setup, n):
        with pytest.raises(ValidationFailed):
            jobs_submit(user=member_setup[0], jobs=[spec()] * n)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_submit_wakes_the_workers_when_it_commits(member_setup):
    alice = member_setup[0]
    one(alice)
    s = connection.settings_dict
    with psycopg.connect(
        host=s["HOST"] or "127.0.0.1", port=s["PORT"] or 5432, user=s["USER"], dbname=s["NAME"], autocommit=True
    ) as listener:
        listener.execute(f"LISTEN {signals.WORKERS_CHANNEL}")
        one(alice)
        jobs_submit(user=alice, jobs=[spec(), spec()])
        notes = [n.payload for n in listener.notifies(timeout=5, stop_after=2)]
    assert notes == [signals.QUEUED, signals.QUEUED]


def test_every_job_column_stores_none_as_null():
    """The INSERT of jobs passes an empty column as NULL without its field's conversion
    (telemachus/db/bulk.py): true of every column of a job."""
    assert [f.name for f in Job._meta.concrete_fields if f.get_db_prep_save(None, connection) is not None] == []


def test_a_submit_checks_exactly_the_budgets_that_count_its_jobs(member_setup, make_user):
    """Configuration.admission_rules picks, per version, what admission_budgets would find among
    all the rules: budgets of everyone, the job's team, its user and the user's keys; not other
    teams' or users', not an executor's, not caps."""
    _, bob, team_a, _, executor = member_setup
    # Carol's id is no team's, so a rule matched by the wrong kind of id would show.
    carol = [make_user(f"u{i}") for i in range(3)][-1]
    assert carol.pk not in {team_a.pk, bob.pk} | set(Team.objects.values_list("pk", flat=True))
    key = ApiKey.objects.create(team=team_a, name="k", principal=carol, digest="d" * 64, prefix="p")
    for scope, subject in [
        ("global", ""),
        ("team", "a"),
        ("team", "b"),
        ("user", carol.username),
        ("user", "bob"),
        ("key", str(key.pk)),
        ("executor", executor.name),
    ]:
        for dimension, window in (("ai.tokens", "day"), ("ai.requests", "minute"), ("ai.concurrency", "")):
            QuotaPolicy.objects.create(scope=scope, subject=subject, dimension=dimension, limit=1000, window=window)
    conf = configuration(config_snapshot())
    subjects = {(team_a.pk, carol.pk)}

    picked = admission_budgets(subjects=subjects, now=timezone.now(), rules=conf.admission_rules(subjects))
    from_all = admission_budgets(subjects=subjects, now=timezone.now(), rules=conf.rules)

    assert [a.rule for a in picked.accounts] == [a.rule for a in from_all.accounts]
    assert sorted((a.rule.scope, a.rule.subject) for a in picked.accounts) == sorted(
        2 * [("global", ""), ("key", str(key.pk)), ("team", "a"), ("user", carol.username)]
    )
