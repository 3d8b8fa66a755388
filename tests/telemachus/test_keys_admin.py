"""The admin shows a new key's or token's secret once, on the page that made it, and never again:
not on any admin page, to an operator or to a staff user allowed to view everything."""

import re

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission
from django.urls import reverse
from rest_framework.test import APIClient

from telemachus.keys.models import ApiKey, PersonalToken
from telemachus.models import AuditEvent
from tests.conftest import chat_body

pytestmark = pytest.mark.django_db


def every_admin_page(client) -> dict[str, str]:
    """Every changelist, add page and change page of every registered model, as `client` sees it."""
    pages = {}
    urls = [reverse("admin:index")]
    for model in admin.site._registry:
        opts = model._meta
        urls.append(reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"))
        urls.append(reverse(f"admin:{opts.app_label}_{opts.model_name}_add"))
        for pk in model._default_manager.values_list("pk", flat=True)[:50]:
            urls.append(reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[pk]))
    for url in urls:
        response = client.get(url)
        assert response.status_code in (200, 302, 403), (url, response.status_code)
        pages[url] = response.content.decode()
    return pages


@pytest.fixture
def made(client, operator, member_setup):
    """An operator made a key and a token in the admin; what each page showed, and the secrets."""
    client.force_login(operator)
    response = client.post(
        reverse("admin:telemachus_apikey_add"),
        {"team": member_setup[2].pk, "name": "crm", "models_text": "m, other", "expires_at_0": "", "expires_at_1": ""},
    )
    assert response.status_code == 200, response.content.decode()[:2000]
    key_page = response.content.decode()
    assert "no-store" in response["Cache-Control"]
    key_secret = re.search(r'<code id="secret"[^>]*>(tm-[A-Za-z0-9_-]+)</code>', key_page).group(1)
    response = client.post(reverse("admin:telemachus_personaltoken_add"), {"user": member_setup[0].pk, "name": "cli"})
    assert response.status_code == 200
    token_secret = re.search(r'<code id="secret"[^>]*>(tmu-[A-Za-z0-9_-]+)</code>', response.content.decode()).group(1)
    return key_page, key_secret, token_secret


def test_the_secret_is_shown_once_and_works(made, member_setup):
    key_page, key_secret, token_secret = made
    assert key_page.count(key_secret) == 1
    key = ApiKey.objects.get(name="crm")
    assert key.allowed_models == ["m", "other"] and key.team == member_setup[2]
    assert AuditEvent.objects.filter(action="api_key.create", source="admin").exists()
    for secret in (key_secret, token_secret):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
        assert client.post("/api/jobs/", chat_body("a"), format="json").status_code == 201


def test_no_admin_page_shows_a_secret_again(made, client):
    _, key_secret, token_secret = made
    pages = every_admin_page(client)
    assert any("crm" in html for html in pages.values()), "the key is listed"
    for url, html in pages.items():
        assert key_secret not in html and token_secret not in html, url
        assert key_secret[8:20] not in html and token_secret[9:20] not in html, url


def test_a_staff_user_who_may_view_everything_obtains_no_usable_secret(made, client, make_user):
    _, key_secret, token_secret = made
    viewer = make_user("viewer", is_staff=True)
    viewer.user_permissions.add(*Permission.objects.filter(codename__startswith="view_"))
    client.force_login(viewer)
    pages = every_admin_page(client)
    assert "crm" in pages[reverse("admin:telemachus_apikey_changelist")]
    found = set()
    for html in pages.values():
        found |= set(re.findall(r"tmu?-[A-Za-z0-9_-]{20,}", html))
    assert not found, "nothing on any page looks like a whole secret"
    # They cannot make one either, nor revoke.
    assert client.get(reverse("admin:telemachus_apikey_add")).status_code == 403
    response = client.post(reverse("admin:telemachus_apikey_add"), {"team": ApiKey.objects.get().team_id, "name": "x"})
    assert response.status_code == 403
    assert client.post(reverse("admin:telemachus_personaltoken_add"), {"user": viewer.pk}).status_code == 403
    assert ApiKey.objects.count() == 1 and PersonalToken.objects.count() == 1
    changelist = client.post(
        reverse("admin:telemachus_apikey_changelist"),
        {"action": "revoke", "_selected_action": [ApiKey.objects.get().pk]},
    )
    assert changelist.status_code in (200, 302)
    assert ApiKey.objects.get().revoked_at is None


def test_an_operator_revokes_in_the_admin(made, client):
    key = ApiKey.objects.get()
    response = client.post(
        reverse("admin:telemachus_apikey_changelist"), {"action": "revoke", "_selected_action": [key.pk]}
    )
    assert response.status_code == 302
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert AuditEvent.objects.filter(action="api_key.revoke", source="admin").exists()
