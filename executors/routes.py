"""Model routes (issue #39): an operator's edits, audited like every configuration change, and the
one read every surface uses to resolve a name (`route_models`). The scheduler decides which of a
route's models a job runs on (scheduler/services/routes.py); this module only keeps the routes."""

from typing import Any

from django.db import transaction

from executors.models import ModelRoute
from telemachus.control.audit import Actor, audit_record, changed_fields
from telemachus.errors import ValidationFailed, unique_or

AUDITED = ("name", "models")


def route_audit_view(route: ModelRoute) -> dict[str, Any]:
    return {"name": route.name, "models": list(route.models)}


def _name_taken(name: Any) -> ValidationFailed:
    return ValidationFailed({"name": [f"A route named {name!r} already exists."]})


def route_create(*, name: str, models: list[str], by: Actor = None) -> ModelRoute:
    """Add a route; audited (`route.create`). The insert moves the configuration version (by
    trigger), so the next submit on any process resolves the name. A name taken meanwhile by a
    concurrent create is refused as the API's check refuses it (400)."""
    with unique_or(_name_taken(name)), transaction.atomic():
        route = ModelRoute.objects.create(name=name, models=list(models))
        audit_record(
            by=by,
            action="route.create",
            object_type="route",
            object_id=route.pk,
            object_repr=route.name,
            after=route_audit_view(route),
        )
    return route


def route_update(*, route: ModelRoute, by: Actor = None, **fields: Any) -> ModelRoute:
    """Apply an operator's edit (name, models); audited with the changed fields before and after,
    nothing written when nothing changes. Jobs already queued keep the models they were given."""
    before = route_audit_view(route)
    for name, value in fields.items():
        setattr(route, name, value)
    after = route_audit_view(route)
    old, new = changed_fields(before, after)
    if not new:
        return route
    with unique_or(_name_taken(fields.get("name"))), transaction.atomic():
        route.save(update_fields=[*fields, "updated_at"])
        audit_record(
            by=by,
            action="route.update",
            object_type="route",
            object_id=route.pk,
            object_repr=route.name,
            before=old,
            after=new,
        )
    return route


def route_delete(*, route: ModelRoute, by: Actor = None) -> None:
    """Remove a route; audited (`route.delete`). Jobs queued on it keep their models."""
    pk, before = route.pk, route_audit_view(route)
    with transaction.atomic():
        route.delete()
        audit_record(
            by=by, action="route.delete", object_type="route", object_id=pk, object_repr=before["name"], before=before
        )
