from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from executors.selectors import executors_usable_by
from quotas.budget import quota_check
from scheduler import signals
from scheduler.models import Job, JobEvent
from scheduler.services.events import event_record
from telemachus import rbac
from telemachus.errors import UnknownModel


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
    enabled executor usable by the team that offers the model, and the budgets (Quota.check) for
    the estimate. Nothing is written when a check fails. Wakes the workers on commit."""
    team_obj = rbac.team_for_submit(user, team)
    rbac.require(user, rbac.JOB_TYPE_PERMISSION[type], team=team_obj)
    model = requirements["model"]
    if not executors_usable_by(team=team_obj, model=model):
        raise UnknownModel(f"No enabled executor available to team {team_obj.slug!r} offers model {model!r}.", model=model)
    quota_check(team_id=team_obj.pk, user_id=user.pk, tokens=requirements.get("est_tokens", 0), now=timezone.now())
    with transaction.atomic():
        job = Job.objects.create(
            type=type,
            user=user,
            team=team_obj,
            priority=priority,
            requirements=requirements,
            model=model,
            cost_estimate=requirements.get("est_tokens", 0),
            input=input,
            meta=meta or {},
        )
        event_record(job=job, event=JobEvent.Type.QUEUED, at=job.submitted_at, priority=priority)
        signals.notify_workers(signals.QUEUED)
    return job
