"""Serializer plumbing shared by every app's API."""

from typing import Any

from rest_framework import serializers


class StrictSerializer(serializers.Serializer):
    """Rejects fields it does not name, so a client that tries to set `status`, `user` or
    `tokens_used` hears about it instead of being silently ignored."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({name: ["This field is not accepted here."] for name in unknown})
        return super().to_internal_value(data)
