"""A backend for Django's tasks API: `@task` functions run as governed `task` jobs.

    TASKS = {"default": {"BACKEND": "scheduler.tasks_backend.TelemachusBackend",
                         "QUEUES": ["default", "big"],
                         "OPTIONS": {"team": "demo", "user": "tasks-bot",
                                     "queues": {"default": {"model": "cpu"},
                                                "big": {"model": "cpu", "memory_mb": 8192}}}}}

`my_task.enqueue(...)` submits a job through `job_submit`, like any other job (RBAC `flows:run`,
budgets, the priority map, the team's queue depth cap); a worker claims it under the same caps
and fair share and runs it on a cpu-node executor (executors/drivers/cpu.py), which finds the
function by its dotted path only when it is a task declared in an installed app. The job's id is
the TaskResult's id; `get_result(id)` and `TaskResult.refresh()` read the job back.

How the tasks API maps onto a job (docs/tasks.md):
  team, user   `enqueue_as(user=..., team=...)` around the call, else OPTIONS["team"] and the service
               user OPTIONS["user"]; a backend alias per team makes `using(backend=...)` choose one.
  arguments    JSON only, checked at enqueue; the job's `input` is
               {"callable": <module path>, "args": [...], "kwargs": {...}, "backend": <alias>}.
  priority     the job's priority (both are -100..100), within the principal's priority map.
  run_after    the job's not-before time: no claim takes it earlier.
  queue_name   requirements, from OPTIONS["queues"] (default: {"default": {"model": "cpu"}}): the
               model a cpu-node executor offers in `capabilities.models`, and optionally `class`
               and `memory_mb`, so a queue can name one executor or a class of them.
  status       queued READY, running RUNNING, done SUCCESSFUL, failed and canceled FAILED.
  errors       one per failed attempt: the task's exception class and traceback; failures outside
               the task (no such task, a pool process died) as JobFailed, a cancel as JobCanceled.
  worker_ids   the worker of each attempt, from the job's `started` events.

Anything that does not map is refused at enqueue with InvalidTask: a queue without requirements,
arguments that are not JSON, a function that is not a declared task of an installed app. The
scheduler's own refusals (Forbidden, TryLater, QuotaExceeded, UnknownModel from telemachus.errors)
pass through as they are, as the REST API would report them.

The API is imported through telemachus/tasks_api.py (Django 6's `django.tasks`, or the
`django-tasks` package on Django 5.2).
"""

import math
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured

from executors.tasks import UnknownTask, declared_task
from scheduler.api.serializers import RequirementsInput
from scheduler.models import Job, JobEvent
from scheduler.services.submit import job_submit
from telemachus.errors import ValidationFailed
from telemachus.tasks_api import (
    DEFAULT_TASK_QUEUE_NAME,
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_enqueued,
)

DEFAULT_QUEUES = {DEFAULT_TASK_QUEUE_NAME: {"model": "cpu"}}
OPTION_NAMES = {"team", "user", "queues"}

STATUS = {
    Job.Status.QUEUED: TaskResultStatus.READY,
    Job.Status.RUNNING: TaskResultStatus.RUNNING,
    Job.Status.DONE: TaskResultStatus.SUCCESSFUL,
    Job.Status.FAILED: TaskResultStatus.FAILED,
    Job.Status.CANCELED: TaskResultStatus.FAILED,
}


class JobFailed(Exception):
    """A task's job failed outside the task function (the task could not be found or called, its
    pool process died, the worker gave up): the TaskError's traceback holds the job's error."""


class JobCanceled(Exception):
    """A task's job was canceled (through the API, the dashboard or `job_cancel`) before it ended."""


JOB_FAILED = f"{JobFailed.__module__}.{JobFailed.__qualname__}"
JOB_CANCELED = f"{JobCanceled.__module__}.{JobCanceled.__qualname__}"


@dataclass(frozen=True)
class Submitter:
    user: User | None
    team: str | None


_submitter: ContextVar[Submitter | None] = ContextVar("telemachus_task_submitter", default=None)


@contextmanager
def enqueue_as(*, user: User | None = None, team: str | None = None) -> Iterator[None]:
    """Tasks enqueued inside this block are submitted by `user` into `team` (a slug), instead of
    the backend's OPTIONS; either may be left to the OPTIONS. A context variable, so it holds for
    this thread or asyncio task only (and follows `aenqueue` into the thread it runs on)."""
    token = _submitter.set(Submitter(user=user, team=team))
    try:
        yield
    finally:
        _submitter.reset(token)


class TelemachusBackend(BaseTaskBackend):
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict) -> None:
        super().__init__(alias, params)
        unknown = sorted(set(self.options) - OPTION_NAMES)
        if unknown:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS'] has unknown keys {unknown}; known: {sorted(OPTION_NAMES)}"
            )
        self.team: str = self.options.get("team") or ""
        self.username: str = self.options.get("user") or ""
        queues = self.options.get("queues", DEFAULT_QUEUES)
        if not isinstance(queues, Mapping) or not queues:
            raise ImproperlyConfigured(f"TASKS[{alias!r}]['OPTIONS']['queues'] must map queue names to requirements")
        self.requirements = {name: _requirements(alias, name, value) for name, value in queues.items()}
        if "QUEUES" not in params:
            self.queues = set(self.requirements)

    def validate_task(self, task: Task) -> None:
        """The API's checks, and a queue must map onto requirements."""
        super().validate_task(task)
        if task.queue_name not in self.requirements:
            raise InvalidTask(
                f"Queue {task.queue_name!r} has no requirements in TASKS[{self.alias!r}]['OPTIONS']['queues'], "
                "so no executor can be chosen for it."
            )

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Submit the task as a `task` job, in the caller's transaction if there is one (workers see
        the job when it commits). Refuses, before anything is written, a task that is not declared
        in an installed app and arguments that are not JSON (InvalidTask); the scheduler's own
        refusals pass through (see the module docstring)."""
        self.validate_task(task)
        try:
            found = declared_task(path=task.module_path)
        except UnknownTask as exc:
            raise InvalidTask(f"{exc}; workers could not find it") from exc
        if found is None:
            raise InvalidTask(
                f"{task.module_path} is not in an installed app: workers run only tasks declared in installed apps."
            )
        _importable_by_workers(task.module_path)
        args = _json_ready(list(args), "args")
        kwargs = _json_ready(dict(kwargs), "kwargs")
        user, team = self._submitter()
        try:
            job = job_submit(
                user=user,
                team=team,
                type=Job.Type.TASK,
                requirements=dict(self.requirements[task.queue_name]),
                input={"callable": task.module_path, "args": args, "kwargs": kwargs, "backend": self.alias},
                priority=task.priority,
                run_after=task.run_after,
                meta={"queue_name": task.queue_name},
            )
        except ValidationFailed as exc:
            raise InvalidTask(f"Telemachus refused the task: {exc.extra['fields']}") from exc
        if job.priority != task.priority:  # clamped to the principal's ceiling by the priority map
            task = task.using(priority=job.priority)
        result = self._result(job, task=task, events=[])
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        """The task's job as a TaskResult: two queries (the job, its start and failure events).
        Raises TaskResultDoesNotExist for an id that is not a job enqueued through this API, or
        whose task is no longer declared."""
        try:
            job_id = int(result_id)
        except (TypeError, ValueError):
            raise TaskResultDoesNotExist(result_id) from None
        job = Job.objects.filter(pk=job_id, type=Job.Type.TASK).first()
        if job is None or "backend" not in job.input:
            raise TaskResultDoesNotExist(result_id)
        try:
            declared = declared_task(path=job.input["callable"])
        except UnknownTask:
            declared = None
        if declared is None:
            raise TaskResultDoesNotExist(f"{result_id}: its task {job.input['callable']} is no longer declared")
        task = declared.using(
            priority=job.priority, queue_name=job.meta.get("queue_name"), run_after=job.run_after, backend=self.alias
        )
        events = list(
            JobEvent.objects.filter(
                job_id=job.pk,
                event__in=[JobEvent.Type.STARTED, JobEvent.Type.RETRY_SCHEDULED, JobEvent.Type.CANCELED],
            )
            .order_by("id")
            .values_list("event", "meta", "at")
        )
        return self._result(job, task=task, events=events)

    def check(self, **kwargs: Any) -> list[CheckMessage]:
        """Queues listed in QUEUES that have no requirements can never be enqueued to."""
        return [
            Error(
                f"TASKS[{self.alias!r}]: queue {name!r} is in QUEUES but has no requirements in OPTIONS['queues']",
                id="telemachus.E001",
            )
            for name in sorted(self.queues - set(self.requirements))
        ]

    def _submitter(self) -> tuple[User, str]:
        context = _submitter.get() or Submitter(user=None, team=None)
        team = context.team or self.team
        if not team:
            raise ImproperlyConfigured(
                f"No team to submit the task into: enqueue inside enqueue_as(team=...) or set "
                f"TASKS[{self.alias!r}]['OPTIONS']['team']."
            )
        if context.user is not None:
            return context.user, team
        if not self.username:
            raise ImproperlyConfigured(
                f"No user to submit the task as: enqueue inside enqueue_as(user=...) or set a service user in "
                f"TASKS[{self.alias!r}]['OPTIONS']['user']."
            )
        User = get_user_model()
        user = User.objects.filter(**{User.USERNAME_FIELD: self.username}).first()
        if user is None:
            raise ImproperlyConfigured(f"TASKS[{self.alias!r}]['OPTIONS']['user'] names no user: {self.username!r}")
        return user, team

    def _result(self, job: Job, *, task: Task, events: list[tuple[str, dict, datetime]]) -> TaskResult:
        errors = [
            TaskError(exception_class_path=JOB_FAILED, traceback=meta.get("error", ""))
            for event, meta, _ in events
            if event == JobEvent.Type.RETRY_SCHEDULED
        ]
        if job.status == Job.Status.FAILED:
            detail = job.result if isinstance(job.result, dict) else {}
            errors.append(
                TaskError(
                    exception_class_path=detail.get("exception_class") or JOB_FAILED,
                    traceback=detail.get("traceback") or job.error,
                )
            )
        elif job.status == Job.Status.CANCELED:
            by = next((meta.get("by") for event, meta, _ in events if event == JobEvent.Type.CANCELED), None)
            errors.append(
                TaskError(
                    exception_class_path=JOB_CANCELED,
                    traceback=f"job {job.pk} was canceled" + (f" by {by}" if by else ""),
                )
            )
        result = TaskResult(  # type: ignore[var-annotated]
            task=task,
            id=str(job.pk),
            status=STATUS[job.status],  # type: ignore[index]
            enqueued_at=job.submitted_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            # started_at is the first attempt's start; the last attempt's is its `started` event's.
            last_attempted_at=max(
                (at for event, _, at in events if event == JobEvent.Type.STARTED), default=job.started_at
            ),
            args=job.input.get("args", []),
            kwargs=job.input.get("kwargs", {}),
            backend=self.alias,
            errors=errors,
            worker_ids=[meta.get("worker", "") for event, meta, _ in events if event == JobEvent.Type.STARTED],
        )
        if job.status == Job.Status.DONE:
            object.__setattr__(result, "_return_value", (job.result or {}).get("value"))
        return result


def _requirements(alias: str, queue: str, value: Any) -> dict[str, Any]:
    """A queue's requirements, checked as a job's are at the API."""
    serializer = RequirementsInput(data=value)
    if not serializer.is_valid():
        raise ImproperlyConfigured(
            f"TASKS[{alias!r}]['OPTIONS']['queues'][{queue!r}] is not a job's requirements: {serializer.errors}"
        )
    return dict(serializer.validated_data)


def _importable_by_workers(path: str) -> None:
    """Refuse a task whose module this process has only in memory (built at run time, or put in
    sys.modules by hand): `declared_task` found it here, but a worker, starting fresh, imports
    modules from their files, and would fail every attempt. The module (and each package above
    it) is looked up by the import system's finders, as a fresh import would, not in sys.modules."""
    module = path.rpartition(".")[0]
    parts = module.split(".")
    search: list[str] | None = None
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        spec = next(
            filter(None, (finder.find_spec(name, search) for finder in sys.meta_path if hasattr(finder, "find_spec"))),
            None,
        )
        if spec is None:
            raise InvalidTask(
                f"{path}: module {name} is not importable from a file, so workers could not find it; "
                "declare tasks in a module of an installed app."
            )
        search = list(spec.submodule_search_locations or [])


def _json_ready(value: Any, where: str) -> Any:
    """`value` as it will reach the task after a trip through JSON (tuples become lists), or
    InvalidTask naming the first part that would not survive the trip unchanged: a type JSON does
    not have (a datetime, a set, bytes, a model instance), a key that is not a string, NaN."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidTask(f"Task {where} must be JSON: {value!r} is not a JSON number.")
        return value
    if isinstance(value, list | tuple):
        return [_json_ready(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise InvalidTask(f"Task {where} must be JSON: key {key!r} is not a string.")
        return {key: _json_ready(item, f"{where}[{key!r}]") for key, item in value.items()}
    raise InvalidTask(
        f"Task {where} must be JSON, not {type(value).__name__} {repr(value)[:80]}; "
        "pass what the task needs to find it (an id, an ISO date string)."
    )
