from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from executors.contract import EMBEDDINGS_API
from executors.selectors import executors_usable_by
from quotas.budget import quota_check
from scheduler import signals
from scheduler.jobtypes import job_input_check
from scheduler.models import Job, JobEvent, QueuePolicy
from scheduler.policy import Admission, AdmissionState, policy_for
from scheduler.selectors import queue_policy
from scheduler.services.events import events_record, job_event
from telemachus import rbac
from telemachus.errors import TryLater, UnknownModel, ValidationFailed
from telemachus.features import feature_require
from telemachus.models import Membership, Team


def job_submit(
    *,
    user: AbstractBaseUser,
    team: str,
    type: str,
    requirements: dict[str, Any],
    input: dict[str, Any],
    priority: int = 0,
    meta: dict[str, Any] | None = None,
    run_after: datetime | None = None,
) -> Job:
    """Admit a job and persist it `queued` with its `queued` event, in one transaction.

    `requirements` and `input` arrive shape-checked (JobSubmitInput); this checks, in order: the
    team (which the user must belong to), that the job's kind is switched on for it (403
    feature_disabled), the permission the job type needs (RBAC.require), the tools it names
    (scheduler/jobtypes.py), an enabled executor usable by the team that offers the model (and
    embeddings, when `requirements.api` asks for them; a tool job needs none), the budgets
    (Quota.check) for the
    estimate, the priority the principal may use (priority map: clamped, with an event, or
    refused, per policy) and the policy's admission (the team's queue depth cap: 429 try_later).
    Nothing is written when a check fails. Locks the team's row while it counts the queue, so
    concurrent submits cannot overfill it. Wakes the workers on commit. With `run_after` (an aware
    datetime) the job waits in the queue, counted against the depth cap, and no claim takes it
    before then (the same not-before time a retry waits on)."""
    team_obj = rbac.team_for_submit(user, team)
    feature_require(feature=type, team=team_obj)
    rbac.require(user, rbac.JOB_TYPE_PERMISSION[type], team=team_obj)
    job_input_check(user=user, team=team_obj, type=type, input=input)
    # A tool job runs in a worker's tool threads, on no executor: it names no model.
    model = "" if type == Job.Type.TOOL else requirements["model"]
    embeddings = requirements.get("api") == EMBEDDINGS_API
    if model and not executors_usable_by(team=team_obj, model=model, embeddings=embeddings):
        offers = f"embeddings of model {model!r}" if embeddings else f"model {model!r}"
        raise UnknownModel(f"No enabled executor available to team {team_obj.slug!r} offers {offers}.", model=model)
    now = timezone.now()
    quota_check(team_id=team_obj.pk, user_id=user.pk, tokens=requirements.get("est_tokens", 0), now=now)
    record = queue_policy()
    allowed, source = priority_ceiling(record, user=user, team=team_obj)
    clamped = priority > allowed
    if clamped and record.priority_over_limit == QueuePolicy.OverLimit.REJECT:
        raise ValidationFailed({"priority": [f"At most {allowed} for you in team {team_obj.slug!r} ({source})."]})
    with transaction.atomic():
        if Team.objects.select_for_update().filter(pk=team_obj.pk).first() is None:  # deleted meanwhile
            raise ValidationFailed({"team": [f"No team {team!r} that you belong to."]})
        job = Job(
            type=type,
            user=user,
            team=team_obj,
            priority=min(priority, allowed),
            requirements=requirements,
            model=model,
            cost_estimate=requirements.get("est_tokens", 0),
            input=input,
            meta=meta or {},
            submitted_at=now,
            run_after=run_after,
            # A job deferred to `run_after` enters the line, and starts ageing, when it may run.
            ready_at=max(now, run_after) if run_after else now,
            queued_at=max(now, run_after) if run_after else now,
        )
        admission = policy_for(record).admit(job, AdmissionState(team=team_obj, now=now))
        if admission.decision == Admission.REJECT:
            raise TryLater(admission.reason, retry_after=admission.retry_after or 60)
        job.save()
        deferred = {"run_after": run_after.isoformat()} if run_after is not None else {}
        events = [job_event(job=job, event=JobEvent.Type.QUEUED, at=now, priority=job.priority, **deferred)]
        if clamped:
            events.append(job_event(job=job, event=JobEvent.Type.PRIORITY_CLAMPED, at=now, requested=priority,
                                    allowed=allowed, reason=source))
        events_record(events)
        signals.notify_workers(signals.QUEUED)
    return job


def priority_ceiling(record: QueuePolicy, *, user: AbstractBaseUser, team: Team) -> tuple[int, str]:
    """The highest priority this principal may use in this team, and which entry of the priority
    map says so: the most specific of user:<name>, team:<slug> and the role wins; operators and
    principals the map does not mention are not limited."""
    if rbac.is_operator(user):
        return Job.PRIORITY_MAX, "operator"
    role = Membership.objects.filter(team=team, user=user).values_list("role", flat=True).first()
    for key in (f"user:{user.get_username()}", f"team:{team.slug}", role):
        if key in record.priority_map:
            return int(record.priority_map[key]), f"priority_map[{key!r}]"
    return Job.PRIORITY_MAX, "no limit"
