"""The dashboard's job list: a page of the jobs the user may see, chosen by the page over its socket
(a tab: running, queued, finished ...; filters: team, type, model, executor; a cursor), pushed
again whenever the database changes.

Running jobs come first, then queued ones, then the rest, each group newest first, so a burst of
queued work never pushes what is running (and its Cancel button) off the first page. Pages are
keyset pages (a cursor names the group and id of the last row shown), so they stay put while
new jobs arrive; each group is read with its own LIMIT query, never by sorting the whole table."""

from dataclasses import dataclass, field
from typing import Any

from django.db.models import QuerySet
from rest_framework import serializers

from scheduler.models import Job
from scheduler.rbac import visible_jobs
from telemachus.http.serializers import StrictSerializer
from telemachus.teams import rbac

RUNNING: list[str] = [Job.Status.RUNNING]
QUEUED: list[str] = [Job.Status.QUEUED]
ENDED: list[str] = list(Job.TERMINAL)
# Each tab: its groups of statuses, in the order they are listed.
TABS: dict[str, list[list[str]]] = {
    "all": [RUNNING, QUEUED, ENDED],
    "active": [RUNNING, QUEUED],
    "running": [RUNNING],
    "queued": [QUEUED],
    "ended": [ENDED],
    "failed": [[str(Job.Status.FAILED)]],
}
PAGE_SIZE = 50
MAX_PAGE_SIZE = 200
# Counts stop here ("10000+"): counting every finished job of a busy year on each push is not worth it.
COUNT_LIMIT = 10_000


@dataclass(frozen=True)
class JobView:
    """What the page asked to see; the default is the first page of every job, running first."""

    tab: str = "all"
    team: str = ""
    type: str = ""
    model: str = ""
    executor: str = ""
    after: tuple[int, int] | None = None  # (group, id) of the last row of the previous page
    size: int = PAGE_SIZE
    filters: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        chosen = {"team": self.team, "type": self.type, "model": self.model, "executor": self.executor}
        object.__setattr__(self, "filters", {name: value for name, value in chosen.items() if value})

    def as_dict(self) -> dict[str, Any]:
        return {
            "tab": self.tab,
            **{name: getattr(self, name) for name in ("team", "type", "model", "executor")},
            "after": list(self.after) if self.after else None,
            "size": self.size,
        }


class JobViewInput(StrictSerializer):
    """`{"view": {...}}` from the page: every field optional, unknown ones refused."""

    tab = serializers.ChoiceField(choices=list(TABS), default="all")
    team = serializers.CharField(max_length=100, allow_blank=True, default="")
    type = serializers.ChoiceField(choices=[("", "any"), *Job.Type.choices], default="")
    model = serializers.CharField(max_length=200, allow_blank=True, default="", trim_whitespace=True)
    executor = serializers.CharField(max_length=64, allow_blank=True, default="")
    after = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=2**63 - 1),
        min_length=2,
        max_length=2,
        allow_null=True,
        default=None,
    )
    size = serializers.IntegerField(min_value=1, max_value=MAX_PAGE_SIZE, default=PAGE_SIZE)

    def validate_after(self, value: list[int] | None) -> tuple[int, int] | None:
        if value is None:
            return None
        if value[0] >= max(len(groups) for groups in TABS.values()):
            raise serializers.ValidationError("Not a cursor this dashboard handed out.")
        return (value[0], value[1])

    def view(self) -> JobView:
        return JobView(**self.validated_data)


def _filtered(jobs: QuerySet[Job], view: JobView) -> QuerySet[Job]:
    filters = view.filters
    lookups = {"team": "team__slug", "type": "type", "model": "model", "executor": "executor__name"}
    return jobs.filter(**{lookups[name]: value for name, value in filters.items()})


def _count(jobs: QuerySet[Job]) -> int:
    """How many, up to COUNT_LIMIT + 1 (more is shown as "10000+")."""
    return jobs.order_by().values("pk")[: COUNT_LIMIT + 1].count()


def jobs_page(*, user: rbac.Principal, view: JobView) -> dict[str, Any]:
    """The page of jobs `view` asks for, among those `user` may see: the jobs (model instances,
    payloads deferred), the cursor of the next page (None: last page), how many jobs each tab
    holds under the filters, and the view itself. Run inside the snapshot's transaction."""
    jobs = _filtered(visible_jobs(user), view)
    groups = TABS[view.tab]
    start, last_id = view.after if view.after and view.after[0] < len(groups) else (0, None)
    found: list[tuple[int, Job]] = []
    for index in range(start, len(groups)):
        wanted = view.size + 1 - len(found)
        if wanted <= 0:
            break
        query = jobs.filter(status__in=groups[index])
        if index == start and last_id is not None:
            query = query.filter(pk__lt=last_id)
        rows = (
            query.select_related("team", "user", "executor")
            .defer("input", "result", "conversation")
            .order_by("-id")[:wanted]
        )
        found += [(index, job) for job in rows]
    more = len(found) > view.size
    found = found[: view.size]
    running, queued = _count(jobs.filter(status__in=RUNNING)), _count(jobs.filter(status__in=QUEUED))
    ended, failed = _count(jobs.filter(status__in=ENDED)), _count(jobs.filter(status=Job.Status.FAILED))
    counts = {
        "all": running + queued + ended,
        "active": running + queued,
        "running": running,
        "queued": queued,
        "ended": ended,
        "failed": failed,
    }
    return {
        "jobs": [job for _, job in found],
        "next": [found[-1][0], found[-1][1].pk] if more else None,
        "counts": counts,
        "total": counts[view.tab],
        "count_limit": COUNT_LIMIT,
    }
