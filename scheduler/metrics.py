"""Prometheus metrics (GET /metrics), with the prometheus_client library.

Two kinds, chosen so that any number of API servers and workers, on any number of hosts, report
one consistent picture without a shared directory or a scrape of every process:

* What the database knows is derived from it at scrape time, in one consistent read
  (`DatabaseCollector`): queue depth per team and priority, running jobs and slots per scope
  against their caps, executors' health and breaker state, budgets left, jobs finished by outcome,
  tokens billed per team, money billed per team and model, and the queue-wait histogram
  (submitted to started, per team). Any API server answers for the whole cluster, and the
  numbers are exact the moment a job changes. Counters and the histogram are totals over the
  jobs (and the spend ledger's days) the database keeps.
* What only a process sees (how long each claim transaction takes, how long executors take to
  answer a dispatch) is observed in that process with prometheus_client histograms. With
  PROMETHEUS_MULTIPROC_DIR set (bin/run sets it), every process on the host writes there and any
  scrape merges them (prometheus_client's multiprocess mode); a worker on another host exposes its
  own on TELEMACHUS_METRICS_BIND (scheduler/worker/probes.py). So are each worker's heartbeat
  (the time of its last beat, for "a worker stopped beating" alerts) and every HTTP response the
  ASGI app sends, by status code (`ResponseCounter`, around the whole app: Django, the gateway).

deploy/ holds a Grafana dashboard and Prometheus alert rules over these names; a test scrapes a
live run and checks that every name they use is served (tests/test_deploy_metrics.py)."""

import os
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from datetime import datetime, timedelta
from itertools import accumulate
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum
from django.utils import timezone
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

from executors.models import Executor
from quotas.models import Spend
from scheduler.batches.models import Batch
from scheduler.batches.services import batch_counts
from scheduler.core.selectors import jobs_running, oldest_finished, queued_by_priority
from scheduler.live.snapshot import Cluster
from scheduler.models import Job, JobTally
from telemachus.db.snapshots import consistent_read
from telemachus.models import Team

WAIT_BUCKETS = JobTally.WAIT_BOUNDS

CLAIM_SECONDS = Histogram(
    "telemachus_claim_duration_seconds",
    "Time one claim transaction took (lock, choose, place, commit).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
DISPATCH_SECONDS = Histogram(
    "telemachus_dispatch_latency_seconds",
    "Time an executor took to answer a dispatch, by executor and outcome.",
    ["executor", "outcome"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)


# Per worker (label: its name, unique per process). In multiprocess mode the largest value of live
# processes: a worker that stops cleanly takes its series with it (`worker_heartbeat_forget`), one
# that dies keeps its last beat, which is what an alert on the beat's age wants to see.
WORKER_HEARTBEAT = Gauge(
    "telemachus_worker_heartbeat_timestamp_seconds",
    "Unix time of the worker's last heartbeat (its lease-renewal loop ran).",
    ["worker"],
    multiprocess_mode="livemax",
)
ROWS_PRUNED = Counter(
    "telemachus_rows_pruned",
    "Rows retention deleted (or, for bodies, prompts and answers removed), by table.",
    ["table"],
)
HTTP_RESPONSES = Counter(
    "telemachus_http_responses",
    "HTTP responses sent by the API server, by status code.",
    ["code"],
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def dispatch_observe(*, executor: Any, outcome: str, seconds: float) -> None:
    """One dispatch's latency; a job that ran on no executor (a tool job) is not a dispatch."""
    if executor is not None:
        DISPATCH_SECONDS.labels(executor.name, outcome).observe(seconds)


def worker_heartbeat_observe(*, worker: str) -> None:
    """The worker `worker` is beating now."""
    WORKER_HEARTBEAT.labels(worker).set_to_current_time()


def worker_heartbeat_forget(*, worker: str) -> None:
    """The worker `worker` stopped on purpose: its heartbeat series goes, so no alert says it is
    missing. In multiprocess mode that is this process's live-gauge file (the process is ending)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(os.getpid())  # (removing a label is not supported there)
    else:
        WORKER_HEARTBEAT.remove(worker)


class ResponseCounter:
    """ASGI middleware counting every HTTP response by status code, whoever answers (Django, the
    gateway's raw responses, the body limit). An application that fails before it answers gets
    the server's 500, counted as such."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                HTTP_RESPONSES.labels(str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                HTTP_RESPONSES.labels("500").inc()
            raise


class DatabaseCollector:
    """The cluster's state and totals, read from the database at scrape time, in one snapshot."""

    def collect(self) -> Iterator[Metric]:
        with consistent_read():
            yield from self._collect()

    def _collect(self) -> Iterator[Metric]:
        now = timezone.now()
        cluster = Cluster.load(now=now)
        teams = dict(Team.objects.values_list("pk", "slug"))
        usernames = dict(
            get_user_model()
            .objects.filter(pk__in=set(cluster.caps.user) | set(cluster.slots.user))
            .values_list("pk", "username")
        )

        depth = GaugeMetricFamily(
            "telemachus_queue_depth", "Queued jobs, by team and priority.", labels=["team", "priority"]
        )
        running = GaugeMetricFamily("telemachus_jobs_running", "Running jobs, by team.", labels=["team"])
        for (team_id, priority), n in queued_by_priority().items():
            depth.add_metric([teams.get(team_id, str(team_id)), str(priority)], n)
        for team_id, n in jobs_running().items():
            running.add_metric([teams.get(team_id, str(team_id))], n)
        yield depth
        yield running
        yield from self._capacity(cluster, teams, usernames)
        yield from self._budgets(cluster)
        yield from self._totals(teams)
        yield self._wait_histogram(teams)
        yield self._oldest_finished(now, teams)
        yield from self._batches(cluster, teams)

    def _batches(self, cluster: Cluster, teams: dict[int, str]) -> Iterator[Metric]:
        """Each batch under way's request counts (one grouped read of its lines' jobs), and the
        slots batch lines hold per executor (docs/batches.md)."""
        requests = GaugeMetricFamily(
            "telemachus_batch_requests",
            "Requests of each batch under way, by state (total, completed, failed, running: queued or running now).",
            labels=["team", "batch", "state"],
        )
        for batch in Batch.objects.filter(status__in=Batch.ACTIVE).order_by("created_at"):
            counts = batch_counts(batch=batch)
            team = teams.get(batch.team_id, str(batch.team_id))
            for state in ("total", "completed", "failed", "running"):
                requests.add_metric([team, batch.pk, state], getattr(counts, state))
        yield requests
        held = GaugeMetricFamily(
            "telemachus_batch_slots_in_use", "Slots held by batch lines, by executor.", labels=["executor"]
        )
        names = {e.pk: e.name for e in cluster.executors}
        for executor_id, n in cluster.slots.batch.items():
            held.add_metric([names.get(executor_id, str(executor_id))], n)
        yield held

    def _oldest_finished(self, now: datetime, teams: dict[int, str]) -> GaugeMetricFamily:
        """How long ago each team's oldest kept finished job ended: past the team's retention by
        more than a pass or two, retention is not keeping up. One query (`oldest_finished`)."""
        oldest = GaugeMetricFamily(
            "telemachus_oldest_finished_job_age_seconds",
            "Age of the oldest finished job still kept, by team (retention deletes it past the team's retention).",
            labels=["team"],
        )
        for team_id, ended in oldest_finished().items():
            oldest.add_metric([teams.get(team_id, str(team_id))], max((now - ended).total_seconds(), 0.0))
        return oldest

    def _capacity(self, cluster: Cluster, teams: dict[int, str], usernames: dict[int, str]) -> Iterator[Metric]:
        """Slots held and caps per scope; each executor's health, breaker and switch."""
        in_use = GaugeMetricFamily(
            "telemachus_slots_in_use", "Slots held, by scope and subject.", labels=["scope", "subject"]
        )
        caps = GaugeMetricFamily(
            "telemachus_slots_cap",
            "Slot cap in force, by scope and subject (absent: uncapped).",
            labels=["scope", "subject"],
        )
        slots = cluster.slots
        in_use.add_metric(["global", ""], slots.total)
        if cluster.caps.global_cap is not None:
            caps.add_metric(["global", ""], cluster.caps.global_cap)
        for team_id in set(slots.team) | set(cluster.caps.team):
            in_use.add_metric(["team", teams.get(team_id, str(team_id))], slots.team[team_id])
            if team_id in cluster.caps.team:
                caps.add_metric(["team", teams.get(team_id, str(team_id))], cluster.caps.team[team_id])
        for user_id in set(slots.user) | set(cluster.caps.user):
            in_use.add_metric(["user", usernames.get(user_id, str(user_id))], slots.user[user_id])
            if user_id in cluster.caps.user:
                caps.add_metric(["user", usernames.get(user_id, str(user_id))], cluster.caps.user[user_id])
        health = GaugeMetricFamily(
            "telemachus_executor_health", "1 for the executor's current health.", labels=["executor", "health"]
        )
        breaker = GaugeMetricFamily(
            "telemachus_executor_breaker", "1 for the executor's current breaker state.", labels=["executor", "state"]
        )
        enabled = GaugeMetricFamily(
            "telemachus_executor_enabled", "1 when the executor takes new work.", labels=["executor"]
        )
        for executor in cluster.executors:
            in_use.add_metric(["executor", executor.name], slots.executor[executor.pk])
            caps.add_metric(["executor", executor.name], cluster.limit(executor))
            for value in Executor.Health.values:
                health.add_metric([executor.name, value], int(executor.health == value))
            for value in Executor.Breaker.values:
                breaker.add_metric([executor.name, value], int(executor.breaker == value))
            enabled.add_metric([executor.name], int(executor.enabled))
        yield from (in_use, caps, health, breaker, enabled)

    def _budgets(self, cluster: Cluster) -> Iterator[Metric]:
        """What is left of each budget in its current window, and its limit."""
        budget_labels = ["scope", "subject", "dimension", "window"]
        remaining = GaugeMetricFamily(
            "telemachus_budget_remaining", "What is left of a budget in its current window.", labels=budget_labels
        )
        limit = GaugeMetricFamily(
            "telemachus_budget_limit",
            "A budget's limit per window (remaining / limit: what is left).",
            labels=budget_labels,
        )
        for account in cluster.budgets.accounts:
            rule = account.rule
            labels = [rule.scope, rule.subject, rule.dimension, rule.window]
            remaining.add_metric(labels, float(max(account.remaining, 0)))
            limit.add_metric(labels, float(rule.limit))
        yield remaining
        yield limit

    def _totals(self, teams: dict[int, str]) -> Iterator[Metric]:
        """Totals since the start: jobs that ended, tokens billed, money spent."""
        finished = CounterMetricFamily(
            "telemachus_jobs_finished",
            "Jobs that ended, by team, type and outcome.",
            labels=["team", "type", "outcome"],
        )
        ended: dict[tuple[int, str, str], int] = defaultdict(int)
        for team_id, kind, status, n in (
            Job.objects.filter(status__in=Job.TERMINAL)
            .order_by()
            .values_list("team_id", "type", "status")
            .annotate(n=Count("id"))
        ):
            ended[(team_id, kind, status)] += n
        # Jobs retention deleted, summed (scheduler/services/retention.py): totals never fall.
        for team_id, kind, status, n in (
            JobTally.objects.order_by().values_list("team_id", "type", "status").annotate(n=Sum("jobs"))
        ):
            ended[(team_id, kind, status)] += n
        for (team_id, kind, status), n in sorted(ended.items()):
            finished.add_metric([teams.get(team_id, str(team_id)), kind, status], n)
        yield finished

        billed = CounterMetricFamily(
            "telemachus_tokens_billed", "Tokens billed (used by dispatches), by team.", labels=["team"]
        )
        tokens_by_team: dict[int, int] = defaultdict(int)
        for team_id, tokens in (
            Job.objects.filter(tokens_used__gt=0).order_by().values_list("team_id").annotate(tokens=Sum("tokens_used"))
        ):
            tokens_by_team[team_id] += tokens
        for team_id, tokens in (
            JobTally.objects.filter(tokens__gt=0).order_by().values_list("team_id").annotate(tokens=Sum("tokens"))
        ):
            tokens_by_team[team_id] += tokens
        for team_id, tokens in sorted(tokens_by_team.items()):
            billed.add_metric([teams.get(team_id, str(team_id))], tokens)
        yield billed

        spent = CounterMetricFamily(
            "telemachus_cost",
            "Money billed for tokens (tokens x the executors' prices), by team and model, in the currency named.",
            labels=["team", "model", "currency"],
        )
        for team_id, model, cost in (
            Spend.objects.order_by().values_list("team_id", "model").annotate(cost=Sum("cost")).filter(cost__gt=0)
        ):
            spent.add_metric([teams.get(team_id, str(team_id)), model, settings.TELEMACHUS_CURRENCY], float(cost))
        yield spent

    def _wait_histogram(self, teams: dict[int, str]) -> HistogramMetricFamily:
        """Queue wait (submitted to started) of every job that has started, per team: one grouped
        query with a conditional count per bucket."""
        wait = ExpressionWrapper(F("started_at") - F("submitted_at"), output_field=DurationField())
        buckets = {
            f"le{i}": Count("id", filter=Q(wait__lte=timedelta(seconds=bound))) for i, bound in enumerate(WAIT_BUCKETS)
        }
        rows = (
            Job.objects.filter(started_at__isnull=False)
            .order_by()
            .annotate(wait=wait)
            .values("team_id")
            .annotate(n=Count("id"), total=Sum("wait"), **buckets)
        )
        family = HistogramMetricFamily(
            "telemachus_job_wait_seconds", "Time jobs waited in the queue before starting.", labels=["team"]
        )
        # Per team: jobs per bucket (not cumulative; the last is +Inf) and the waits' sum.
        counts: dict[int, list[int]] = defaultdict(lambda: [0] * (len(WAIT_BUCKETS) + 1))
        sums: dict[int, float] = defaultdict(float)
        for row in rows:
            cumulative = [row[f"le{i}"] for i in range(len(WAIT_BUCKETS))] + [row["n"]]  # type: ignore[literal-required]
            per = counts[row["team_id"]]
            for i, n in enumerate(cumulative):
                per[i] += n - (cumulative[i - 1] if i else 0)
            total = row["total"]
            sums[row["team_id"]] += total.total_seconds() if total is not None else 0.0
        # Started jobs retention deleted, by the bucket their wait fell in.
        for team_id, bucket, n, waited in (
            JobTally.objects.filter(wait_bucket__gte=0)
            .order_by()
            .values_list("team_id", "wait_bucket")
            .annotate(n=Sum("jobs"), waited=Sum("wait_seconds"))
        ):
            counts[team_id][bucket] += n
            sums[team_id] += waited
        for team_id, per in sorted(counts.items()):
            bounds = [str(float(bound)) for bound in WAIT_BUCKETS] + ["+Inf"]
            family.add_metric(
                [teams.get(team_id, str(team_id))],
                list(zip(bounds, accumulate(per), strict=True)),
                sums[team_id],
            )
        return family


class _ThisProcess:
    """This process's own metrics (the default registry), when not in multiprocess mode."""

    def collect(self) -> Iterator[Metric]:
        return iter(REGISTRY.collect())


def metrics_exposition(accept: str = "") -> tuple[bytes, str]:
    """The exposition of everything above for one scrape, in the format the scraper's Accept header
    asks for (Prometheus text by default, OpenMetrics on request), and its content type."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(_ThisProcess())
    registry.register(DatabaseCollector())
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


def rows_pruned_observe(counts: dict[str, int]) -> None:
    """A worker's retention pass deleted these rows, per table."""
    for table, n in counts.items():
        ROWS_PRUNED.labels(table=table).inc(n)
