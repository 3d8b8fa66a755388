import re
from contextlib import AbstractContextManager
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from executors.api import managed_executor
from scheduler.api.serializers import (
    JobBulkOutput,
    JobBulkSubmitInput,
    JobEventOutput,
    JobListFilter,
    JobOutput,
    JobSubmitInput,
)
from scheduler.live.snapshot import queue_snapshot
from scheduler.models import Job, JobEvent
from scheduler.rbac import require_cancel, visible_jobs
from scheduler.services.cancel import job_cancel
from scheduler.services.requeue import job_requeue
from scheduler.services.retention import job_missing
from scheduler.services.submit import MAX_BULK, JobSpec, job_submit, jobs_submit
from telemachus import tracing
from telemachus.errors import NotFound, ValidationFailed
from telemachus.http.pagination import OldestFirstCursorPagination
from telemachus.http.throttles import SubmitRateThrottle
from telemachus.keys.authentication import request_api_key
from telemachus.keys.models import ApiKey


def submit_team(data: dict[str, Any], key: ApiKey | None) -> dict[str, Any]:
    """A submission's fields with its team: the one it names, else (an app's API key may leave
    it out) the key's team."""
    if data.get("team") or key is None:
        return data
    return {**data, "team": key.team.slug}


def visible_job(request: Request, job_id: int) -> Job:
    job = visible_jobs(request.user).select_related("team", "user", "executor").filter(pk=job_id).first()
    if job is None:
        raise NotFound(job_missing(job_id))
    return job


class JobListCreateApi(ListAPIView[Job]):
    """GET lists the jobs the caller may see, newest first; POST submits a job."""

    serializer_class = JobOutput
    filter_serializer = JobListFilter
    throttle_classes = [SubmitRateThrottle]
    serves_api_keys = True

    @extend_schema(
        parameters=[
            OpenApiParameter("status", str, many=True, enum=Job.Status.values),
            OpenApiParameter("type", str, many=True, enum=Job.Type.values),
            OpenApiParameter("team", str),
        ]
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)

    def get_queryset(self) -> QuerySet[Job]:
        filters = JobListFilter(data=self.request.query_params)
        filters.is_valid(raise_exception=True)
        jobs = visible_jobs(self.request.user).select_related("team", "user", "executor")
        if statuses := filters.validated_data.get("status"):
            jobs = jobs.filter(status__in=statuses)
        if types := filters.validated_data.get("type"):
            jobs = jobs.filter(type__in=types)
        if team := filters.validated_data.get("team"):
            jobs = jobs.filter(team__slug=team)
        return jobs

    @extend_schema(request=JobSubmitInput, responses={201: JobOutput})
    def post(self, request: Request) -> Response:
        """The submit continues the caller's trace (W3C `traceparent`): a request span, and the
        submit's (whose context the job keeps for the spans of its work: docs/tracing.md)."""
        if tracing.active:
            with request_span(request, "/api/jobs/") as span:
                response = self._submit(request)
                span.set_attribute("http.response.status_code", response.status_code)
                return response
        return self._submit(request)

    def _submit(self, request: Request) -> Response:
        key = request_api_key(request)
        submission = JobSubmitInput(data=request.data, context={"key": key})
        submission.is_valid(raise_exception=True)
        job = job_submit(user=request.user, key=key, **submit_team(submission.validated_data, key))
        return Response(JobOutput(job).data, status=status.HTTP_201_CREATED)


class JobBulkSubmitApi(APIView):
    """POST submits up to 1,000 jobs at once, all or nothing: each is validated and admitted as
    `POST /api/jobs/` would, the team's queue depth cap counts the whole batch, and nothing is
    written unless every job is accepted. A refusal is the error single submit gives, with
    `index`: the position of the first failing job in `jobs`. Each job counts against the submit
    rate, as if submitted alone."""

    throttle_classes = [SubmitRateThrottle]

    def submit_cost(self, request: Request) -> int:
        """How many jobs the body submits, for the submit rate."""
        body = _bulk_body(request)
        jobs = body.get("jobs") if isinstance(body, dict) else None
        return min(len(jobs), MAX_BULK) if isinstance(jobs, list) and jobs else 1

    serves_api_keys = True

    @extend_schema(request=JobBulkSubmitInput, responses={201: JobBulkOutput})
    def post(self, request: Request) -> Response:
        if tracing.active:
            with request_span(request, "/api/jobs/bulk/") as span:
                response = self._submit(request)
                span.set_attribute("http.response.status_code", response.status_code)
                return response
        return self._submit(request)

    def _submit(self, request: Request) -> Response:
        key = request_api_key(request)
        bulk = JobBulkSubmitInput(data=_bulk_body(request), context={"key": key})
        if not bulk.is_valid():
            raise _first_failing_job(bulk.errors)
        jobs = jobs_submit(
            user=request.user, jobs=[JobSpec(**submit_team(job, key)) for job in bulk.validated_data["jobs"]], key=key
        )
        return Response(JobBulkOutput({"jobs": jobs}).data, status=status.HTTP_201_CREATED)


BULK_ITEM = re.compile(r"^jobs\[(\d+)\]")


def request_span(request: Request, route: str) -> AbstractContextManager[Any]:
    """A submit request's span (kind SERVER), continuing the caller's trace from its headers."""
    return tracing.span(
        f"{request.method} {route}",
        parent=tracing.context_from_headers(request.headers),
        server=True,
        attributes={"http.request.method": request.method, "http.route": route},
    )


def _bulk_body(request: Request) -> Any:
    """The parsed body; a parser's refusal (text, nesting, numbers) names the job at `jobs[i]...`."""
    try:
        return request.data
    except ValidationFailed as exc:
        raise _naming_the_job(exc) from None


def _naming_the_job(exc: ValidationFailed) -> ValidationFailed:
    """A body error at `jobs[i]...` with the job's `index`, as every other bulk error has."""
    found = next(filter(None, (BULK_ITEM.match(str(path)) for path in exc.extra.get("fields") or {})), None)
    if found is not None:
        exc.detail = f"Job {found.group(1)} is invalid."
        exc.extra["index"] = int(found.group(1))
    return exc


def _first_failing_job(errors: dict[str, Any]) -> ValidationFailed:
    """The bulk body's errors as the API's validation error: the first invalid job's fields with
    its `index`, or what is wrong with the body itself."""
    items = errors.get("jobs")
    if isinstance(items, dict) and items and all(isinstance(i, int) for i in items):  # {index: fields}
        index = min(items)
        fields = items[index]
        if not isinstance(fields, dict):  # the job is not an object at all
            fields = {api_settings.NON_FIELD_ERRORS_KEY: fields}
        failed = ValidationFailed(fields, detail=f"Job {index} is invalid.")
        failed.extra["index"] = index
        return failed
    return ValidationFailed(errors)


class JobDetailApi(APIView):
    serves_api_keys = True

    @extend_schema(responses=JobOutput)
    def get(self, request: Request, job_id: int) -> Response:
        return Response(JobOutput(visible_job(request, job_id)).data)


class JobCancelApi(APIView):
    serves_api_keys = True

    @extend_schema(request=None, responses=JobOutput)
    def post(self, request: Request, job_id: int) -> Response:
        require_cancel(request.user, visible_job(request, job_id))
        job = job_cancel(job_id=job_id, by=request.user)
        return Response(JobOutput(visible_job(request, job.pk)).data)


class JobRequeueApi(APIView):
    """Operators send a failed or canceled job back to the queue (scheduler.manage)."""

    @extend_schema(request=None, responses=JobOutput)
    def post(self, request: Request, job_id: int) -> Response:
        job = job_requeue(job_id=visible_job(request, job_id).pk, by=request.user)
        return Response(JobOutput(visible_job(request, job.pk)).data)


class JobEventListApi(ListAPIView[JobEvent]):
    serializer_class = JobEventOutput
    pagination_class = OldestFirstCursorPagination
    serves_api_keys = True

    def get_queryset(self) -> QuerySet[JobEvent]:
        job = visible_job(self.request, self.kwargs["job_id"])
        return JobEvent.objects.filter(job=job).select_related("executor")


class QueueApi(APIView):
    """Live state: depth per team, slots in use per scope against caps, executors."""

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        return Response(queue_snapshot(user=request.user))


class ExecutorEventListApi(ListAPIView[JobEvent]):
    """Breaker transitions and health changes of one executor, oldest first."""

    serializer_class = JobEventOutput
    pagination_class = OldestFirstCursorPagination

    def get_queryset(self) -> QuerySet[JobEvent]:
        executor = managed_executor(self.request, self.kwargs["executor_id"])
        return JobEvent.objects.filter(executor=executor, job__isnull=True).select_related("executor")
