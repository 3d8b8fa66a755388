"""A worked custom queue policy: during business hours one team's work goes first.

Enable it with TELEMACHUS_QUEUE_POLICY=docs.examples.business_hours.BusinessHoursPolicy (or by
setting `policy_class` in the QueuePolicy record). Outside business hours it is the default fair
share. See docs/policy.md."""

from collections.abc import Iterator
from datetime import datetime
from zoneinfo import ZoneInfo

from scheduler.core.policy import FairSharePolicy
from scheduler.core.state import ClaimState
from scheduler.models import Job


class BusinessHoursPolicy(FairSharePolicy):
    first_team = "support"
    timezone = ZoneInfo("Europe/Amsterdam")
    opens, closes = 9, 17  # hours, Monday to Friday

    def in_business_hours(self, now: datetime) -> bool:
        local = now.astimezone(self.timezone)
        return local.weekday() < 5 and self.opens <= local.hour < self.closes

    def order(self, state: ClaimState, *, limit: int) -> Iterator[Job]:
        if self.in_business_hours(state.now):
            heads = self.eligible_heads(state, limit=limit)
            first = next((t for t, slug in state.team_slugs.items() if slug == self.first_team), None)
            # The team's own line first, in its own order; the claim skips what does not fit.
            yield from heads.get(first, [])
        # Then everyone by fair share (the claim skips jobs it has already taken).
        yield from super().order(state, limit=limit)
