"""`job.failed` webhooks: a job that ended `failed` (no attempt left: a finish that gave up, a
flow's round or tool that failed it, a recovery that failed it) is reported to its team's webhooks,
in the transaction that ends it. Never its input or result: its id, type, model, user, executor,
attempts, time and error."""

from collections.abc import Iterable

from scheduler.models import Job
from telemachus.models import Webhook
from telemachus.webhooks.services import WebhookEvent, webhooks_emit

ERROR_CHARS = 1000


def jobs_failed_emit(*, jobs: Iterable[Job]) -> int:
    """Emit `job.failed` for the jobs among `jobs` that ended failed (ended by `Job.end`, saved or
    not: the caller's transaction writes them). No query when none did; else one for the webhooks
    and one insert. Returns the deliveries written."""
    failed = [job for job in jobs if job.status == Job.Status.FAILED]
    if not failed:
        return 0
    return webhooks_emit(
        events=[
            WebhookEvent(
                type=Webhook.Event.JOB_FAILED,
                data={
                    "job": {
                        "id": job.pk,
                        "type": job.type,
                        "model": job.model,
                        "user_id": job.user_id,
                        "key_id": job.key_id,
                        "executor_id": job.executor_id,
                        "attempts": job.attempts,
                        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
                        "error": job.error[:ERROR_CHARS],
                    }
                },
                teams=frozenset({job.team_id}),
            )
            for job in failed
        ]
    )
