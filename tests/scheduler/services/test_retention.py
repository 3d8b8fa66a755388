"""Retention: finished jobs and what only they own are deleted past their team's retention or the
deployment's; prompts and answers go past the body retention; ledgers and logs past theirs."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from quotas.models import Spend, Usage
from scheduler.core.selectors import oldest_finished
from scheduler.metrics import metrics_exposition
from scheduler.models import Job, JobEvent, JobTally, Slot
from scheduler.services.claim import job_claim
from scheduler.services.finish import job_finish
from scheduler.services.requeue import job_requeue
from scheduler.services.retention import body_hold, body_hold_release, body_stripped, prune_once, wait_bucket
from telemachus.errors import Conflict
from telemachus.models import AuditEvent, Team

pytestmark = pytest.mark.django_db

MARKER = "zebra-7c1f-secret"


@pytest.fixture
def finished(member_setup, submit):
    """finished(team, age_hours): a job of the team's member (or `user`) that ran and ended done, `age` ago."""
    alice, bob, a, b, _ = member_setup
    users = {a.pk: alice, b.pk: bob}

    def make(team, age_hours: float, *, status: str = "done", content: str = "hi", user=None) -> Job:
        from scheduler.services.submit import job_submit

        job = job_submit(
            user=user or users[team.pk],
            team=team.slug,
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": content}], "max_tokens": 8},
        )
        (claim,) = job_claim(worker="w1", limit=1).claims
        assert claim.job.pk == job.pk
        job_finish(
            job_id=job.pk,
            lease=claim.lease,
            result={"choices": [{"message": {"role": "assistant", "content": f"answer {content}"}}]},
            tokens_used=10,
        )
        then = timezone.now() - timedelta(hours=age_hours)
        Job.objects.filter(pk=job.pk).update(finished_at=then, status=status)
        return Job.objects.get(pk=job.pk)

    return make


def exists(job: Job) -> bool:
    return Job.objects.filter(pk=job.pk).exists()


class TestJobs:
    def test_deployment_retention_deletes_old_jobs_and_their_events(self, finished, member_setup, settings):
        settings.TELEMACHUS_RETENTION_HOURS = 24
        _, _, a, _, _ = member_setup
        old, failed, young = finished(a, 25), finished(a, 30, status="failed"), finished(a, 23)
        report = prune_once()
        assert report.counts["jobs"] == 2
        assert not exists(old) and not exists(failed) and exists(young)
        assert not JobEvent.objects.filter(job_id__in=[old.pk, failed.pk]).exists()
        assert JobEvent.objects.filter(job_id=young.pk).exists()

    def test_running_and_queued_jobs_stay_whatever_their_age(self, member_setup, submit, settings):
        settings.TELEMACHUS_RETENTION_HOURS = 0
        alice, _, a, _, _ = member_setup
        running, queued = submit(alice, a), submit(alice, a)
        job_claim(worker="w1", limit=1)
        Job.objects.update(submitted_at=timezone.now() - timedelta(days=400))
        assert prune_once().total == 0
        assert {j.status for j in Job.objects.filter(pk__in=[running.pk, queued.pk])} == {"running", "queued"}

    def test_team_retention_overrides_the_deployment(self, finished, member_setup, settings):
        settings.TELEMACHUS_RETENTION_HOURS = 24
        _, _, a, b, _ = member_setup
        Team.objects.filter(pk=a.pk).update(retention_hours=1)
        Team.objects.filter(pk=b.pk).update(retention_hours=100)
        a_old, b_old, b_older = finished(a, 2), finished(b, 50), finished(b, 101)
        prune_once()
        assert not exists(a_old) and exists(b_old) and not exists(b_older)

    def test_leftover_slots_go_with_their_job(self, finished, member_setup, settings):
        settings.TELEMACHUS_RETENTION_HOURS = 1
        alice, _, a, _, executor = member_setup
        job = finished(a, 2)
        Slot.objects.create(job=job, executor=executor, team=a, user=alice, worker="w1", acquired_at=timezone.now())
        prune_once()
        assert not exists(job) and not Slot.objects.exists()

    def test_batches_until_nothing_is_due(self, finished, member_setup, settings):
        settings.TELEMACHUS_RETENTION_HOURS = 1
        _, _, a, _, _ = member_setup
        for _ in range(5):
            finished(a, 2)
        assert prune_once(limit=2).counts["jobs"] == 5
        assert not Job.objects.exists()

    def test_the_command_prunes_a_backlog(self, finished, member_setup, settings, capsys):
        settings.TELEMACHUS_RETENTION_HOURS = 1
        _, _, a, _, _ = member_setup
        for _ in range(3):
            finished(a, 2)
        call_command("telemachus_prune", batch=2)
        assert "jobs: 3" in capsys.readouterr().out
        assert not Job.objects.exists()


class TestTotals:
    def test_spend_and_metrics_totals_are_the_same_after_pruning(self, finished, member_setup, settings, api, operator):
        settings.TELEMACHUS_RETENTION_HOURS = 1
        _, _, a, b, _ = member_setup
        finished(a, 2), finished(a, 2, status="failed"), finished(b, 0.5)
        Spend.objects.create(
            day=timezone.now().date(), team=a, user=operator, model="m", requests=2, tokens=20, cost=Decimal("0.5")
        )
        spend = api(operator).get("/api/spend/").json()
        before = _totals(metrics_exposition()[0].decode())
        assert prune_once().counts["jobs"] == 2
        assert api(operator).get("/api/spend/").json() == spend
        assert _totals(metrics_exposition()[0].decode()) == pytest.approx(before)
        assert JobTally.objects.filter(team=a).count() == 2

    def test_wait_buckets(self):
        now = timezone.now()
        assert wait_bucket(now, None) == (-1, 0.0)
        assert wait_bucket(now, now + timedelta(seconds=0.07))[0] == 1
        assert wait_bucket(now, now + timedelta(hours=2))[0] == len(JobTally.WAIT_BOUNDS)


def _totals(text: str) -> dict[str, float]:
    """The series of the totals retention must keep, and their values."""
    names = ("telemachus_jobs_finished", "telemachus_tokens_billed", "telemachus_job_wait_seconds", "telemachus_cost")
    lines = (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(names) and "_created" not in line)
    return {series: float(value) for series, value in lines}


class TestOtherTables:
    def test_ended_usage_windows_audit_and_executor_events(self, member_setup, settings):
        settings.TELEMACHUS_RETENTION_HOURS = 24
        settings.TELEMACHUS_AUDIT_RETENTION_DAYS = 30
        _, _, _, _, executor = member_setup
        now = timezone.now()
        old = Usage.objects.create(scope="team", subject="a", window="hour", window_start=now - timedelta(hours=30))
        held = Usage.objects.create(
            scope="team", subject="b", window="hour", window_start=now - timedelta(hours=30), reserved_tokens=5
        )
        month = Usage.objects.create(scope="team", subject="a", window="month", window_start=now - timedelta(days=20))
        current = Usage.objects.create(scope="team", subject="a", window="hour", window_start=now)
        AuditEvent.objects.create(action="team.update", object_type="team", at=now - timedelta(days=31))
        recent_audit = AuditEvent.objects.create(action="team.update", object_type="team", at=now - timedelta(days=29))
        JobEvent.objects.create(job=None, executor=executor, event="breaker_opened", at=now - timedelta(hours=25))
        recent_event = JobEvent.objects.create(job=None, executor=executor, event="breaker_closed", at=now)
        report = prune_once()
        assert set(Usage.objects.values_list("pk", flat=True)) == {held.pk, month.pk, current.pk}
        assert not Usage.objects.filter(pk=old.pk).exists()
        assert AuditEvent.objects.filter(at__lt=now - timedelta(days=30)).count() == 0
        assert AuditEvent.objects.filter(pk=recent_audit.pk).exists()
        assert list(JobEvent.objects.filter(job=None).values_list("pk", flat=True)) == [recent_event.pk]
        assert report.counts["usage"] == 1 and report.counts["executor events"] == 1


class TestTeamFields:
    def test_operators_set_a_teams_retention_audited(self, member_setup, api, operator):
        client = api(operator)
        answer = client.patch("/api/teams/a/", {"retention_hours": 48, "body_retention_hours": 0}, format="json")
        assert answer.status_code == 200, answer.json()
        assert (answer.json()["retention_hours"], answer.json()["body_retention_hours"]) == (48, 0)
        event = AuditEvent.objects.get(action="team.update")
        assert (event.before, event.after) == (
            {"retention_hours": None, "body_retention_hours": None},
            {"retention_hours": 48, "body_retention_hours": 0},
        )
        assert client.patch("/api/teams/a/", {"retention_hours": None}, format="json").json()["retention_hours"] is None
        assert client.patch("/api/teams/a/", {"retention_hours": -1}, format="json").status_code == 400

    def test_members_cannot(self, member_setup, api):
        alice = member_setup[0]
        assert api(alice).patch("/api/teams/a/", {"retention_hours": 1}, format="json").status_code == 403


class TestBodies:
    def test_body_goes_after_its_retention_and_the_rest_stays(self, finished, member_setup, settings):
        settings.TELEMACHUS_RETENTION_HOURS = 24
        _, _, a, _, _ = member_setup
        Team.objects.filter(pk=a.pk).update(body_retention_hours=1)
        old, young = finished(a, 2, content=MARKER), finished(a, 0.5, content="young")
        before = Job.objects.get(pk=old.pk)
        assert prune_once().counts["bodies"] == 1
        job = Job.objects.get(pk=old.pk)
        assert job.body_removed_at is not None
        assert (job.input, job.result, job.conversation) == ({"max_tokens": 8}, None, [])
        kept = ("model", "tokens_used", "cost", "status", "error", "submitted_at", "started_at", "finished_at")
        assert all(getattr(job, name) == getattr(before, name) for name in kept)
        assert JobEvent.objects.filter(job=job).count() == JobEvent.objects.filter(job=young).count()
        assert Job.objects.get(pk=young.pk).input["messages"][0]["content"] == "young"
        assert prune_once().total == 0

    def test_zero_removes_at_once_and_the_job_goes_at_its_own_retention(self, finished, member_setup, settings):
        settings.TELEMACHUS_RETENTION_HOURS = 24
        _, _, a, _, _ = member_setup
        Team.objects.filter(pk=a.pk).update(body_retention_hours=0)
        job, old = finished(a, 0), finished(a, 25)
        assert prune_once().counts == {"bodies": 1, "jobs": 1}
        assert Job.objects.get(pk=job.pk).body_removed_at is not None and not exists(old)
        Job.objects.filter(pk=job.pk).update(finished_at=timezone.now() - timedelta(hours=25))
        assert prune_once().counts == {"jobs": 1}

    def test_a_waiting_caller_holds_the_body_until_it_lets_go(self, finished, member_setup, settings):
        _, _, a, _, _ = member_setup
        Team.objects.filter(pk=a.pk).update(body_retention_hours=0)
        job = finished(a, 0)
        assert body_hold(job_id=job.pk, until=timezone.now() + timedelta(minutes=5))
        assert prune_once().total == 0
        body_hold_release(job_id=job.pk)
        assert prune_once().counts == {"bodies": 1}
        assert not body_hold(job_id=job.pk, until=timezone.now() + timedelta(minutes=5))

    def test_a_waiting_caller_holds_a_job_its_team_keeps_no_time(self, finished, member_setup):
        _, _, a, _, _ = member_setup
        Team.objects.filter(pk=a.pk).update(retention_hours=0)
        job = finished(a, 0)
        assert body_hold(job_id=job.pk, until=timezone.now() + timedelta(minutes=5))
        assert prune_once().total == 0 and exists(job)
        body_hold_release(job_id=job.pk)
        assert prune_once().counts == {"jobs": 1}

    def test_a_v1_call_holds_its_job_only_where_it_could_go_first(self, member_setup):
        from scheduler.services.submit import job_submit

        alice, _, a, _, _ = member_setup

        def call():
            return job_submit(
                user=alice,
                team="a",
                type="chat",
                requirements={"model": "m"},
                input={"messages": [{"role": "user", "content": "hi"}]},
                body_hold_seconds=600,
            )

        assert call().body_hold_until is None
        Team.objects.filter(pk=a.pk).update(body_retention_hours=0)
        assert call().body_hold_until is not None
        Team.objects.filter(pk=a.pk).update(body_retention_hours=None, retention_hours=0.1)
        assert call().body_hold_until is not None

    def test_no_hold_where_the_team_keeps_bodies(self, finished, member_setup):
        _, _, a, _, _ = member_setup
        assert not body_hold(job_id=finished(a, 0).pk, until=timezone.now() + timedelta(minutes=5))

    def test_a_job_without_its_body_cannot_be_requeued(self, finished, member_setup, operator):
        _, _, a, _, _ = member_setup
        Team.objects.filter(pk=a.pk).update(body_retention_hours=0)
        job = finished(a, 0, status="failed")
        prune_once()
        with pytest.raises(Conflict):
            job_requeue(job_id=job.pk, by=operator)

    def test_nothing_of_a_removed_body_stays_in_the_database(self, finished, member_setup, settings):
        settings.TELEMACHUS_RETENTION_HOURS = 24
        _, _, a, _, _ = member_setup
        Team.objects.filter(pk=a.pk).update(body_retention_hours=0)
        finished(a, 0, content=MARKER)
        assert database_holds(MARKER)
        prune_once()
        assert not database_holds(MARKER)


def database_holds(text: str) -> list[str]:
    """The tables with a row that holds `text` anywhere, as the database stores it."""
    found = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            if any(text in str(value) for row in cursor.fetchall() for value in row):
                found.append(table)
    return found


class TestMetrics:
    def test_oldest_finished_job_age_per_team(self, finished, member_setup, settings):
        settings.TELEMACHUS_RETENTION_HOURS = 24
        _, _, a, _, _ = member_setup
        finished(a, 30), finished(a, 2)
        text = metrics_exposition()[0].decode()
        assert 30 * 3600 <= _totals_of(text, 'telemachus_oldest_finished_job_age_seconds{team="a"}') < 31 * 3600
        prune_once()
        age = _totals_of(metrics_exposition()[0].decode(), 'telemachus_oldest_finished_job_age_seconds{team="a"}')
        assert 2 * 3600 <= age < 3 * 3600

    def test_oldest_finished_reads_every_team_in_one_query(
        self, finished, member_setup, make_team, make_user, django_assert_num_queries
    ):
        """Given five teams, each with a job that ended with its body and one older or younger
        whose body was removed, and a team with no finished job: one query reads each team's
        oldest kept job, the earlier of the two kinds, and leaves the idle team out."""
        alice, bob, a, b, _ = member_setup
        members = [(alice, a), (bob, b)]
        for slug in ("c", "d", "e"):
            user = make_user(f"user-{slug}")
            members.append((user, make_team(slug, {user: "member"})))
        make_team("idle", {make_user("idle-user"): "member"})
        expected = {}
        for n, (user, team) in enumerate(members):
            ended = finished(team, 10 + n, user=user)
            stripped = finished(team, 20 + n if n % 2 else 5, user=user)
            Job.objects.filter(pk=stripped.pk).update(body_removed_at=timezone.now())
            expected[team.pk] = min(ended.finished_at, stripped.finished_at)
        with django_assert_num_queries(1):
            found = oldest_finished()
        assert found == expected


def _totals_of(text: str, series: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(series + " ")]
    return float(line.rsplit(" ", 1)[1])


class TestFlows:
    def test_a_flow_goes_whole_after_its_last_round(self, member_setup, settings):
        from scheduler.services.submit import job_submit

        settings.TELEMACHUS_RETENTION_HOURS = 1
        alice, _, a, _, _ = member_setup
        flow = job_submit(
            user=alice,
            team="a",
            type="flow",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": MARKER}], "tools": ["echo"]},
        )
        long_ago = timezone.now() - timedelta(hours=5)
        for round_no in (1, 2):
            JobEvent.objects.create(job=flow, event="round_started", at=long_ago, meta={"round": round_no})
            JobEvent.objects.create(job=flow, event="round_finished", at=long_ago, meta={"round": round_no})
        conversation = [{"role": "assistant", "content": MARKER}, {"role": "tool", "content": MARKER}]
        # A flow between rounds, however old its rounds, is not finished: it stays.
        Job.objects.filter(pk=flow.pk).update(rounds=2, conversation=conversation, submitted_at=long_ago)
        assert prune_once().total == 0 and exists(flow)
        Job.objects.filter(pk=flow.pk).update(status="done", finished_at=long_ago)
        assert prune_once().counts["jobs"] == 1
        assert not exists(flow) and not JobEvent.objects.filter(job_id=flow.pk).exists()
        assert not database_holds(MARKER)


class TestDashboard:
    def test_operators_see_the_retention_in_force_and_the_tables(self, finished, member_setup, operator, settings):
        from scheduler.live.snapshot import dashboard_state

        settings.TELEMACHUS_RETENTION_HOURS = 48
        alice, _, a, _, _ = member_setup
        Team.objects.filter(pk=a.pk).update(retention_hours=2, body_retention_hours=0.5)
        finished(a, 1)
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("ANALYZE scheduler_job")
        state = dashboard_state(user=operator)
        rows = {t["team"]: (t["retention_hours"], t["body_retention_hours"]) for t in state["queue"]["teams"]}
        assert rows == {"a": (2, 0.5), "b": (48, None)}
        assert state["retention"]["hours"] == 48 and state["retention"]["tables"]["jobs"] == 1
        assert dashboard_state(user=alice)["retention"] is None


@pytest.mark.parametrize(
    ("input", "kept"),
    [
        (
            {"messages": [{"role": "user", "content": MARKER}], "max_tokens": 8, "stream": True},
            {"max_tokens": 8, "stream": True},
        ),
        ({"input": [MARKER], "encoding_format": "float"}, {"encoding_format": "float"}),
        ({"text": MARKER, "target_lang": "fr"}, {"target_lang": "fr"}),
        ({"tool": "echo", "arguments": {"text": MARKER}}, {"tool": "echo"}),
        (
            {"callable": "tests.declared_tasks.add", "args": [MARKER], "kwargs": {"x": MARKER}, "backend": "default"},
            {"callable": "tests.declared_tasks.add", "backend": "default"},
        ),
        (
            {"messages": [{"role": "user", "content": MARKER}], "tools": ["echo"], "max_rounds": 3},
            {"tools": ["echo"], "max_rounds": 3},
        ),
    ],
    ids=["chat", "embeddings", "translate", "tool", "task", "flow"],
)
def test_what_each_job_type_keeps_of_its_input(input, kept):
    """A task keeps what the tasks backend needs to find it again (`callable`, `backend`)."""
    assert body_stripped(input) == kept
