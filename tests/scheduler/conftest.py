import pytest

from quotas.models import QuotaPolicy
from scheduler.services.submit import job_submit


@pytest.fixture
def submit():
    def make(user, team, model="m", priority=0, **requirements):
        return job_submit(
            user=user,
            team=team.slug if hasattr(team, "slug") else team,
            type="chat",
            priority=priority,
            requirements={"model": model, **requirements},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )

    return make


@pytest.fixture
def cap(db):
    """cap("global", None, 3) / cap("team", "a", 1): an ai.concurrency rule."""

    def make(scope, subject, limit):
        return QuotaPolicy.objects.create(scope=scope, subject=subject or "", dimension="ai.concurrency", limit=limit)

    return make
