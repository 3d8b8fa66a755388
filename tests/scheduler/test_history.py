"""The dashboard's history: what a worker records as each bucket closes (scheduler/services/
history.py), what the charts read back (scheduler/live/history.py, GET /api/queue/history/), and
a real worker process recording it on its own, a burst that comes and goes within a bucket
included."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from executors.models import Executor
from scheduler.live.history import history_series
from scheduler.models import Job, JobEvent, QueueSample
from scheduler.services.cancel import job_cancel
from scheduler.services.claim import job_claim
from scheduler.services.history import HistoryRecorder, bucket_start
from tests.processes import wait_until

pytestmark = pytest.mark.django_db

SIZE = timedelta(seconds=60)


@pytest.fixture
def closed_bucket(settings):
    """A bucket that closed two minutes ago: [start, start + 60 s); the workers read the gauges
    every 2 s."""
    settings.TELEMACHUS_HISTORY_BUCKET_SECONDS = 60
    settings.TELEMACHUS_HISTORY_RETENTION_HOURS = 24
    settings.TELEMACHUS_HISTORY_SAMPLE_SECONDS = 2
    return bucket_start(timezone.now()) - 2 * SIZE


def watched(recorder: HistoryRecorder, bucket) -> HistoryRecorder:
    """As a worker that was running when the bucket began: it read the gauges at its start."""
    assert recorder.record(now=bucket + timedelta(seconds=0.2)) is None
    return recorder


def ended_job(user, team, *, start, tokens, status=Job.Status.DONE, waited=5.0, ran=10.0, cost="0"):
    """A job that waited `waited` s and ran `ran` s, both inside the bucket that begins at `start`."""
    submitted = start + timedelta(seconds=1)
    started = submitted + timedelta(seconds=waited)
    finished = started + timedelta(seconds=ran)
    job = Job.objects.create(
        type="chat",
        user=user,
        team=team,
        model="m",
        status=status,
        submitted_at=submitted,
        started_at=started,
        finished_at=finished,
        tokens_used=tokens,
        cost=Decimal(cost),
        attempts=1,
    )
    JobEvent.objects.create(job=job, event=JobEvent.Type.STARTED, at=started)
    ended = JobEvent.Type.FINISHED if status == Job.Status.DONE else JobEvent.Type.FAILED
    JobEvent.objects.create(job=job, event=ended, at=finished)
    return job


def values(**subject) -> dict:
    return QueueSample.objects.get(**subject).values


class TestRecord:
    def test_a_closed_bucket_holds_gauges_what_ended_and_the_waits(self, member_setup, submit, closed_bucket):
        """Given team a with two queued jobs and one running, and jobs of both teams that started
        and ended within the bucket: the bucket's rows hold each team's depth and slots, what ended
        with its tokens, and the waits' p50/p95; the executor its slots against its limit."""
        alice, bob, team_a, team_b, executor = member_setup
        for _ in range(3):
            submit(alice, team_a)
        job_claim(worker="w", limit=1)
        ended_job(alice, team_a, start=closed_bucket, tokens=30, waited=2.0, cost="0.5")
        ended_job(alice, team_a, start=closed_bucket, tokens=20, waited=4.0, status=Job.Status.FAILED, cost="0.25")
        ended_job(bob, team_b, start=closed_bucket, tokens=100, waited=10.0, cost="1")
        # Outside the bucket: a job that ended a minute later counts in the next bucket, not this one.
        ended_job(bob, team_b, start=closed_bucket + SIZE, tokens=999)

        recorder = watched(HistoryRecorder(), closed_bucket)
        assert recorder.record(now=closed_bucket + SIZE + timedelta(seconds=0.5)) == closed_bucket

        whole = values(at=closed_bucket, team=None, executor=None)
        assert whole == {
            "queued": 2,
            "running": 1,
            "in_use": 1,
            "cap": None,
            "finished": 2,
            "failed": 1,
            "tokens": 150.0,
            "cost": 1.75,
            "started": 3,
            "wait_p50": 4.0,
            "wait_p95": 9.4,
        }
        assert values(at=closed_bucket, team=team_a) == {
            "queued": 2,
            "running": 1,
            "in_use": 1,
            "finished": 1,
            "failed": 1,
            "tokens": 50.0,
            "cost": 0.75,
            "started": 2,
            "wait_p50": 3.0,
            "wait_p95": 3.9,
        }
        assert values(at=closed_bucket, team=team_b)["tokens"] == 100.0
        assert values(at=closed_bucket, executor=executor) == {
            "in_use": 1,
            "limit": 4,
            "enabled": True,
            "health": "ok",
        }

    def test_a_burst_that_drains_within_the_bucket_keeps_its_peak(self, member_setup, submit, closed_bucket):
        """Given nothing queued as the bucket begins and as it closes, and in between five jobs
        queued, two of them running on the executor's slots, then all canceled: the bucket holds
        the most that was queued, running and in use at once, for the team, the executor and the
        whole queue, where a reading at the close alone said nothing happened."""
        alice, _, team_a, _, executor = member_setup
        recorder = watched(HistoryRecorder(), closed_bucket)
        jobs = [submit(alice, team_a) for _ in range(5)]
        recorder.record(now=closed_bucket + timedelta(seconds=10))
        job_claim(worker="w", limit=2)
        recorder.record(now=closed_bucket + timedelta(seconds=12))
        for job in jobs:
            job_cancel(job_id=job.pk, bill=False)
        recorder.record(now=closed_bucket + timedelta(seconds=14))

        assert recorder.record(now=closed_bucket + SIZE + timedelta(seconds=0.2)) == closed_bucket
        whole = values(at=closed_bucket, team=None, executor=None)
        assert (whole["queued"], whole["running"], whole["in_use"]) == (5, 2, 2)
        assert values(at=closed_bucket, team=team_a) == {"queued": 5, "running": 2, "in_use": 2}
        assert values(at=closed_bucket, executor=executor)["in_use"] == 2
        # The next bucket began with the queue empty: its peaks so far are nothing.
        assert recorder.record(now=closed_bucket + 2 * SIZE + timedelta(seconds=0.2)) == closed_bucket + SIZE
        assert values(at=closed_bucket + SIZE, team=None, executor=None)["queued"] == 0

    def test_a_worker_that_came_late_leaves_the_bucket_to_one_that_watched_it(
        self, member_setup, submit, closed_bucket
    ):
        """A worker started halfway through the bucket has not seen its first half: as the bucket
        closes it leaves the writing to a worker that read the gauges all through, and writes the
        bucket itself only if it is still missing a sample interval later."""
        alice, _, team_a, _, _ = member_setup
        late, close = HistoryRecorder(), closed_bucket + SIZE
        assert late.record(now=closed_bucket + timedelta(seconds=30)) is None
        assert late.record(now=close + timedelta(seconds=0.2)) is None
        assert not QueueSample.objects.filter(at=closed_bucket).exists()
        submit(alice, team_a)
        assert late.record(now=close + timedelta(seconds=2.2)) == closed_bucket
        assert values(at=closed_bucket, team=None, executor=None)["queued"] == 1

        # The next bucket it watched whole: it writes it as soon as it closes.
        assert late.record(now=close + SIZE + timedelta(seconds=0.2)) == close

    def test_written_once_per_bucket_whoever_gets_there(self, member_setup, submit, closed_bucket):
        """A second worker finds the bucket written and leaves it; and should its insert race the
        first (it read before the first committed), the unique constraints drop the duplicates."""
        alice, _, team_a, _, executor = member_setup
        submit(alice, team_a)
        at = closed_bucket + SIZE + timedelta(seconds=0.5)
        first = watched(HistoryRecorder(), closed_bucket)
        assert first.record(now=at) == closed_bucket
        assert first.record(now=at) is None
        assert watched(HistoryRecorder(), closed_bucket).record(now=at) is None
        before = QueueSample.objects.count()
        QueueSample.objects.filter(team=None, executor=None).delete()  # as if the first had not been seen
        assert watched(HistoryRecorder(), closed_bucket).record(now=at) == closed_bucket
        assert QueueSample.objects.count() == before
        assert QueueSample.objects.filter(executor=executor).count() == 1

    def test_rows_past_the_retention_are_deleted(self, member_setup, closed_bucket, settings):
        old = closed_bucket - timedelta(hours=25)
        QueueSample.objects.create(at=old, values={"queued": 1})
        QueueSample.objects.create(at=old, team=member_setup[2], values={"queued": 1})
        watched(HistoryRecorder(), closed_bucket).record(now=closed_bucket + SIZE)
        assert not QueueSample.objects.filter(at=old).exists()
        assert QueueSample.objects.filter(at=closed_bucket).exists()

    def test_a_minute_that_ended_more_jobs_than_a_statement_takes_parameters(self, member_setup, closed_bucket):
        """At 1,100 jobs a second a minute ends 66,000 jobs, more than a PostgreSQL statement may
        name one by one (65,535 parameters): the bucket is written all the same, each team's ended
        jobs and tokens counted (the recorder once failed at every close; this SQLite build takes
        250,000, so the failure showed on PostgreSQL only)."""
        alice, bob, team_a, team_b, _ = member_setup
        ended = closed_bucket + timedelta(seconds=30)
        per_team = {team_a: (alice, 36_000), team_b: (bob, 30_000)}
        for team, (user, n) in per_team.items():
            jobs = Job.objects.bulk_create(
                Job(
                    type="chat",
                    user=user,
                    team=team,
                    model="m",
                    status=Job.Status.DONE,
                    submitted_at=ended,
                    started_at=ended,
                    finished_at=ended,
                    tokens_used=2,
                    attempts=1,
                )
                for _ in range(n)
            )
            JobEvent.objects.bulk_create(JobEvent(job=job, event=JobEvent.Type.FINISHED, at=ended) for job in jobs)

        recorder = watched(HistoryRecorder(), closed_bucket)
        assert recorder.record(now=closed_bucket + SIZE + timedelta(seconds=0.5)) == closed_bucket
        whole = values(at=closed_bucket, team=None, executor=None)
        assert (whole["finished"], whole["tokens"]) == (66_000, 132_000.0)
        assert values(at=closed_bucket, team=team_a)["finished"] == 36_000
        assert values(at=closed_bucket, team=team_b)["tokens"] == 60_000.0

    def test_reads_the_gauges_every_sample_interval_and_as_each_bucket_closes(self, closed_bucket):
        recorder = HistoryRecorder()
        assert recorder.next_in(now=closed_bucket + timedelta(seconds=10)) == 2
        assert recorder.next_in(now=closed_bucket + timedelta(seconds=57.5)) == pytest.approx(2.7)
        assert recorder.next_in(now=closed_bucket + timedelta(seconds=59.5)) == pytest.approx(0.7)


class TestSeries:
    @pytest.fixture
    def recorded(self, make_user, make_team, make_executor, closed_bucket):
        """Three buckets: the first and the last recorded, the middle one not (no worker ran)."""
        alice = make_user("alice")
        alpha, secret = make_team("alpha", {alice: "member"}), make_team("secretteam")
        shared, own = make_executor("shared"), make_executor("secretexec", team=secret)
        first, last = closed_bucket - 2 * SIZE, closed_bucket
        for at, queued in ((first, 5), (last, 7)):
            QueueSample.objects.create(at=at, values={"queued": queued + 3, "finished": 2, "wait_p95": 1.5})
            QueueSample.objects.create(at=at, team=secret, values={"queued": 3, "tokens": 40})
            QueueSample.objects.create(at=at, executor=shared, values={"in_use": 2, "limit": 4})
            QueueSample.objects.create(at=at, executor=own, values={"in_use": 1, "limit": 1})
        QueueSample.objects.create(at=last, team=alpha, values={"queued": queued, "tokens": 12})
        return alice, first, last

    def test_aligned_columns_with_gaps_and_zeros(self, recorded, operator, closed_bucket):
        _, first, last = recorded
        series = history_series(user=operator, minutes=10, now=closed_bucket + SIZE + timedelta(seconds=5))
        ends = [int((at + SIZE).timestamp()) for at in (first, first + SIZE, last)]
        assert series["times"] == ends, "the series start at the first recorded bucket"
        assert series["since"] == int(first.timestamp()), "where the first step begins"
        assert series["currency"] == "USD"
        assert series["global"]["queued"] == [8, None, 10], "a bucket no worker recorded is a gap"
        assert series["global"]["failed"] == [0, None, 0]
        # Team alpha had no row in the first bucket: nothing queued then, not unknown.
        assert series["teams"]["alpha"]["queued"] == [0, None, 7]
        assert series["teams"]["alpha"]["tokens"] == [0, None, 12]
        assert series["executors"]["shared"] == {"in_use": [2, None, 2], "limit": [4, None, 4]}

    def test_long_ranges_fold_buckets_keeping_peaks_and_adding_counts(self, recorded, operator, closed_bucket):
        series = history_series(user=operator, minutes=24 * 60, now=closed_bucket + SIZE + timedelta(seconds=5))
        assert series["step_seconds"] == 240 and len(series["times"]) <= 360
        recorded_steps = [i for i, v in enumerate(series["global"]["queued"]) if v is not None]
        queued = [series["global"]["queued"][i] for i in recorded_steps]
        finished = [series["global"]["finished"][i] for i in recorded_steps]
        assert max(queued) == 10 and sum(finished) == 4

    def test_members_see_their_teams_and_the_executors_they_may_use(self, recorded, closed_bucket):
        alice, _, _ = recorded
        series = history_series(user=alice, minutes=10, now=closed_bucket + SIZE + timedelta(seconds=5))
        assert set(series["teams"]) == {"alpha"} and set(series["executors"]) == {"shared"}
        assert "secret" not in str(series)

    def test_few_queries(self, recorded, operator, closed_bucket, django_assert_max_num_queries):
        with django_assert_max_num_queries(4):
            history_series(user=operator, minutes=60, now=closed_bucket + SIZE)


class TestApi:
    def test_shape_and_validation(self, api, member_setup, closed_bucket):
        alice = member_setup[0]
        QueueSample.objects.create(at=closed_bucket, values={"queued": 1})
        body = api(alice).get("/api/queue/history/?minutes=15").json()
        assert body["bucket_seconds"] == 60 and body["minutes"] == 15 and body["global"]["queued"][0] == 1
        assert set(body["teams"]) == {"a"}
        for query, field in (("minutes=0", "minutes"), ("minutes=99999", "minutes"), ("hours=1", "hours")):
            response = api(alice).get(f"/api/queue/history/?{query}")
            assert response.status_code == 400 and field in response.json()["fields"], query
        assert api().get("/api/queue/history/").status_code == 401


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_burst_a_worker_sees_come_and_go_within_a_bucket_is_recorded(processes, member_setup, submit, settings):
    """Given a worker with six-second buckets that reads the gauges every 0.2 s, and 40 jobs
    submitted just after a bucket begins to an executor with 4 slots that answers in 0.1 s: the
    burst is over within the bucket, and the bucket's row holds it (the queue's peak, all 4
    slots busy), where the reading at its close alone found nothing queued or running."""
    alice, _, team_a, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 100})
    settings.TELEMACHUS_HISTORY_BUCKET_SECONDS = 6
    processes.worker("w1", TELEMACHUS_HISTORY_BUCKET_SECONDS="6", TELEMACHUS_HISTORY_SAMPLE_SECONDS="0.2")
    wait_until(lambda: QueueSample.objects.exists(), timeout=30, what="the worker to record a bucket")

    def early_in_a_bucket() -> bool:
        now = timezone.now()
        return timedelta(seconds=0.3) <= now - bucket_start(now) <= timedelta(seconds=1)

    wait_until(early_in_a_bucket, timeout=10, what="a bucket's first second")
    start = bucket_start(timezone.now())
    for _ in range(40):
        submit(alice, team_a)
    wait_until(
        lambda: QueueSample.objects.filter(at=start, team=None, executor=None).exists(), timeout=20, what="its row"
    )
    whole = values(at=start, team=None, executor=None)
    assert whole["finished"] == 40, f"the burst was to end within the bucket: {whole}"
    assert whole["queued"] >= 10 and whole["running"] == 4 and whole["in_use"] == 4, whole
    assert values(at=start, executor=executor)["in_use"] == 4
    assert values(at=start, team=team_a)["queued"] == whole["queued"]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_running_worker_records_the_history(processes, member_setup, submit):
    """Given a worker with one-second buckets and work queued, rows appear within seconds, and
    the worker keeps writing one set per bucket."""
    alice, _, team_a, _, _ = member_setup
    for _ in range(3):
        submit(alice, team_a)
    processes.worker("w1", TELEMACHUS_HISTORY_BUCKET_SECONDS="1")
    wait_until(
        lambda: QueueSample.objects.filter(team=None, executor=None).count() >= 3, timeout=20, what="three buckets"
    )
    globals_ = list(QueueSample.objects.filter(team=None, executor=None).values_list("at", flat=True))
    assert len(globals_) == len(set(globals_))
    assert all((b - a).total_seconds() >= 1 for a, b in zip(globals_, globals_[1:], strict=False))
