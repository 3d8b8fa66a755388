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
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from datetime import timedelta
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
from scheduler.live.snapshot import Cluster, consistent_read
from scheduler.models import Job
from telemachus.models import Team

WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)

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
        for team_id, status, priority, n in (
            Job.objects.filter(status__in=[Job.Status.QUEUED, Job.Status.RUNNING])
            .order_by()
            .values_list("team_id", "status", "priority")
            .annotate(n=Count("id"))
        ):
            if status == Job.Status.QUEUED:
                depth.add_metric([teams.get(team_id, str(team_id)), str(priority)], n)
        for team_id, n in (
            Job.objects.filter(status=Job.Status.RUNNING).order_by().values_list("team_id").annotate(n=Count("id"))
        ):
            running.add_metric([teams.get(team_id, str(team_id))], n)
        yield depth
        yield running

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

        finished = CounterMetricFamily(
            "telemachus_jobs_finished",
            "Jobs that ended, by team, type and outcome.",
            labels=["team", "type", "outcome"],
        )
        for team_id, kind, status, n in (
            Job.objects.filter(status__in=Job.TERMINAL)
            .order_by()
            .values_list("team_id", "type", "status")
            .annotate(n=Count("id"))
        ):
            finished.add_metric([teams.get(team_id, str(team_id)), kind, status], n)
        yield finished

        billed = CounterMetricFamily(
            "telemachus_tokens_billed", "Tokens billed (used by dispatches), by team.", labels=["team"]
        )
        for team_id, tokens in (
            Job.objects.filter(tokens_used__gt=0).order_by().values_list("team_id").annotate(tokens=Sum("tokens_used"))
        ):
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
        yield self._wait_histogram(teams)

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
        for row in rows:
            cumulative = [(str(float(bound)), row[f"le{i}"]) for i, bound in enumerate(WAIT_BUCKETS)]  # type: ignore[literal-required]
            cumulative.append(("+Inf", row["n"]))
            total = row["total"]
            family.add_metric(
                [teams.get(row["team_id"], str(row["team_id"]))],
                cumulative,
                total.total_seconds() if total is not None else 0.0,
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
