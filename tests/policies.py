"""Policies for tests that start worker processes, which load them by dotted path."""

from datetime import datetime

from docs.examples.business_hours import BusinessHoursPolicy


class AlwaysBusinessHours(BusinessHoursPolicy):
    def in_business_hours(self, now: datetime) -> bool:
        return True
