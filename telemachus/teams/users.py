"""Creating users without the admin, so an operator can set up a team over the API alone."""

import secrets

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission, User
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction

from telemachus.control.audit import Actor, audit_record
from telemachus.errors import ValidationFailed, unique_or
from telemachus.keys.services import personal_token_issue


def user_create(
    *,
    username: str,
    email: str = "",
    password: str | None = None,
    operator: bool = False,
    token: bool = False,
    by: Actor,
) -> tuple[User, str | None]:
    """A new user, and their API token when `token` (shown once, to the caller). Without a password
    the user is invited: no password sign-in until one is set (`changepassword`, or the admin), but
    a token works at once. `operator` grants scheduler.manage. Audited (`user.create`); the
    password never is."""
    User = get_user_model()
    if User.objects.filter(username=username).exists():
        raise ValidationFailed({"username": [f"A user {username!r} already exists."]})
    if password is not None:
        try:
            validate_password(password, User(username=username, email=email))
        except ValidationError as exc:
            raise ValidationFailed({"password": list(exc.messages)}) from None
    exists = ValidationFailed({"username": [f"A user {username!r} already exists."]})
    with unique_or(exists), transaction.atomic():
        user = User.objects.create_user(username=username, email=email, password=password)
        if operator:
            user.user_permissions.add(Permission.objects.get(content_type__app_label="scheduler", codename="manage"))
        key = personal_token_issue(user=user, name="api", by=by)[1] if token else None
        audit_record(
            by=by,
            action="user.create",
            object_type="user",
            object_id=username,
            object_repr=username,
            after={
                "username": username,
                "email": email,
                "operator": operator,
                "invited": password is None,
                "token": bool(token),
            },
        )
    return user, key


def administrator_create(*, username: str, email: str = "", by: Actor) -> tuple[User, str]:
    """A superuser (the admin site, every operator permission) with a generated password, returned
    to the caller to be shown once: a production instance's first administrator, without the demo
    (`manage.py telemachus_admin`). The password is 24 characters from `secrets` (144 bits), so no
    weak one can be chosen, and it never passes through a command line or an environment variable.
    Audited (`user.create`, administrator: true); the password never is. ValidationFailed when the
    username is taken."""
    User = get_user_model()
    exists = ValidationFailed({"username": [f"A user {username!r} already exists."]})
    if User.objects.filter(username=username).exists():
        raise exists
    password = secrets.token_urlsafe(18)
    with unique_or(exists), transaction.atomic():
        user = User.objects.create_superuser(username=username, email=email, password=password)
        audit_record(
            by=by,
            action="user.create",
            object_type="user",
            object_id=username,
            object_repr=username,
            after={"username": username, "email": email, "administrator": True},
        )
    return user, password
