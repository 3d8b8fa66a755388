"""`manage.py telemachus_admin --username NAME`: a production instance's first administrator
without the demo, non-interactively, its generated password printed once; safe to run again."""

import io

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from telemachus.models import AuditEvent, Team

pytestmark = pytest.mark.django_db


def admin_command(*args: str) -> str:
    out = io.StringIO()
    call_command("telemachus_admin", *args, stdout=out)
    return out.getvalue()


def test_it_creates_a_superuser_whose_password_is_shown_once(client):
    output = admin_command("--username", "root", "--email", "ops@example.com")
    password = output.split("password (shown once): ")[1].split()[0]
    user = get_user_model().objects.get(username="root")
    assert user.is_superuser and user.is_staff and user.email == "ops@example.com"
    assert len(password) >= 24 and user.check_password(password)
    assert client.login(username="root", password=password)
    # Audited, without the password; and no demo alongside.
    event = AuditEvent.objects.get(action="user.create", object_id="root")
    assert event.after == {"username": "root", "email": "ops@example.com", "administrator": True}
    assert password not in str(event.after)
    assert not Team.objects.exists()


def test_run_again_it_leaves_the_administrator_and_prints_no_password():
    first = admin_command("--username", "root")
    password = first.split("password (shown once): ")[1].split()[0]
    second = admin_command("--username", "root")
    assert "administrator 'root' exists; left as it is" in second and "password (shown once)" not in second
    assert get_user_model().objects.get(username="root").check_password(password)


def test_an_existing_user_who_is_not_an_administrator_is_never_promoted(make_user):
    make_user("root")
    with pytest.raises(CommandError, match="exists and is not an administrator"):
        admin_command("--username", "root")
    assert not get_user_model().objects.get(username="root").is_superuser
