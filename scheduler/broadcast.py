"""Live events for browsers and API streams, through the channel layer. Group names and payloads
are defined here and nowhere else. Sends are best effort: a lost live event never changes a job."""

import logging

from channels.layers import get_channel_layer

log = logging.getLogger("telemachus.broadcast")


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


async def job_delta_send(job_id: int, text: str) -> None:
    """A streamed job's next text delta, for whoever watches the job (the app-facing stream)."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        await layer.group_send(job_group(job_id), {"type": "job.delta", "job": job_id, "text": text})
    except Exception:  # a dashboard hiccup must not fail a model call
        log.warning("could not broadcast a delta of job %d", job_id, exc_info=True)


DASHBOARD_GROUP = "dashboard"


async def dashboard_changed_send() -> None:
    """Tell every open dashboard (in every process, with a Redis layer) to re-read now: sent after
    a dashboard action commits."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        await layer.group_send(DASHBOARD_GROUP, {"type": "dashboard.changed"})
    except Exception:
        log.warning("could not tell dashboards of a change", exc_info=True)
