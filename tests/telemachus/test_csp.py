"""A Content-Security-Policy on every page, with the dashboard's inline script carrying the
request's nonce (so it keeps working while injected scripts do not run)."""

import re

import pytest
from django.test import Client

from scheduler.models import QueuePolicy

pytestmark = pytest.mark.django_db


def policy(response) -> dict[str, list[str]]:
    header = response["Content-Security-Policy"]
    return {part.split()[0]: part.split()[1:] for part in header.split(";") if part.strip()}


def test_the_dashboard_scripts_carry_the_nonce_of_the_policy(member_setup):
    browser = Client()
    browser.force_login(member_setup[0])
    page = browser.get("/dashboard/")
    directives = policy(page)
    nonces = [v for v in directives["script-src"] if v.startswith("'nonce-")]
    assert len(nonces) == 1 and "'unsafe-inline'" not in directives["script-src"]
    scripts = re.findall(rb"<script[^>]*>", page.content)
    assert scripts, "the dashboard has scripts"
    for tag in scripts:
        assert f'nonce="{nonces[0][7:-1]}"'.encode() in tag or b" src=" in tag, tag
    assert directives["frame-ancestors"] == ["'none'"] and directives["object-src"] == ["'none'"]


def test_each_response_has_a_fresh_nonce(member_setup):
    browser = Client()
    browser.force_login(member_setup[0])
    first, second = (policy(browser.get("/dashboard/"))["script-src"] for _ in range(2))
    assert first != second


@pytest.mark.parametrize("path", ["/login/", "/admin/login/", "/api/docs/"])
def test_other_pages_have_the_policy_and_no_inline_script(path):
    page = Client().get(path)
    assert page.status_code == 200 and "script-src 'self'" in page["Content-Security-Policy"]
    inline = [tag for tag in re.findall(rb"<script[^>]*>", page.content) if b" src=" not in tag]
    assert inline == [], inline


@pytest.mark.parametrize("path", ["/admin/", "/admin/scheduler/job/", "/admin/scheduler/queuepolicy/1/change/",
                                  "/admin/executors/executor/add/", "/admin/auth/user/"])
def test_admin_pages_need_no_inline_script(operator, path):
    QueuePolicy.objects.get_or_create(pk=1)
    browser = Client()
    browser.force_login(operator)
    page = browser.get(path)
    assert page.status_code == 200
    inline = [tag for tag in re.findall(rb"<script[^>]*>", page.content) if b" src=" not in tag]
    assert inline == [], inline
