from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from executors.contract import EMBEDDINGS_API
from executors.selectors import executors_usable_by
from quotas.budget import quota_check
from scheduler import signals
from scheduler.models import Job, JobEvent, QueuePolicy
from scheduler.policy import Admission, AdmissionState, policy_for
from scheduler.selectors import queue_policy
from scheduler.services.events import events_record, job_event
from telemachus import rbac
from telemachus.errors import TryLater, UnknownModel, ValidationFailed
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
) -> Job:
    """Admit a job and persist it `queued` with its `queued` event, in one transaction.

    `requirements` and `input` arrive shape-checked (JobSubmitInput); this checks, in order: the
    team (which the user must belong to), the permission the job type needs (RBAC.require), an
    enabled executor usable by the team that offers the model (and embeddings, when
    `requirements.api` asks for them), the budgets (Quota.check) for the
    estimate, the priority the principal may use (priority map: clamped, with an event, or
    refused, per policy) and the policy's admission (the team's queue depth cap: 429 try_later).
    Nothing is written when a check fails. Locks the team's row while it counts the queue, so
    concurrent submits cannot overfill it. Wakes the workers on commit."""
    team_obj = rbac.team_for_submit(user, team)
    rbac.require(user, rbac.JOB_TYPE_PERMISSION[type], team=team_obj)
    model = requirements["model"]
    embeddings = requirements.get("api") == EMBEDDINGS_API
    if not executors_usable_by(team=team_obj, model=model, embeddings=embeddings):
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
        Team.objects.select_for_update().filter(pk=team_obj.pk).first()
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
        )
        admission = policy_for(record).admit(job, AdmissionState(team=team_obj, now=now))
        if admission.decision == Admission.REJECT:
            raise TryLater(admission.reason, retry_after=admission.retry_after or 60)
        job.save()
        events = [job_event(job=job, event=JobEvent.Type.QUEUED, at=now, priority=job.priority)]
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
