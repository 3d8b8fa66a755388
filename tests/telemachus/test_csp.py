"""A Content-Security-Policy on every page: scripts only from the site's own static files, or inline
with the request's nonce, so injected scripts do not run."""

import re

import pytest
from csp.middleware import CSPMiddleware
from django.http import HttpResponse
from django.test import Client

from scheduler.models import QueuePolicy

pytestmark = pytest.mark.django_db


def policy(response) -> dict[str, list[str]]:
    header = response["Content-Security-Policy"]
    return {part.split()[0]: part.split()[1:] for part in header.split(";") if part.strip()}


def test_the_dashboard_runs_only_its_own_static_scripts(member_setup):
    browser = Client()
    browser.force_login(member_setup[0])
    page = browser.get("/dashboard/")
    directives = policy(page)
    assert directives["script-src"][0] == "'self'" and "'unsafe-inline'" not in directives["script-src"]
    scripts = re.findall(rb"<script[^>]*>", page.content)
    assert scripts, "the dashboard has scripts"
    assert all(b' src="/static/' in tag for tag in scripts), scripts
    assert directives["frame-ancestors"] == ["'none'"] and directives["object-src"] == ["'none'"]


def test_an_inline_script_needs_a_fresh_nonce_each_response(rf):
    def page(request):
        return HttpResponse(f'<script nonce="{request.csp_nonce}"></script>')

    first, second = (policy(CSPMiddleware(page)(rf.get("/")))["script-src"] for _ in range(2))
    assert any(v.startswith("'nonce-") for v in first) and first != second


@pytest.mark.parametrize("path", ["/login/", "/admin/login/", "/api/docs/"])
def test_other_pages_have_the_policy_and_no_inline_script(path):
    page = Client().get(path)
    assert page.status_code == 200 and "script-src 'self'" in page["Content-Security-Policy"]
    inline = [tag for tag in re.findall(rb"<script[^>]*>", page.content) if b" src=" not in tag]
    assert inline == [], inline


@pytest.mark.parametrize(
    "path",
    [
        "/admin/",
        "/admin/scheduler/job/",
        "/admin/scheduler/queuepolicy/1/change/",
        "/admin/executors/executor/add/",
        "/admin/auth/user/",
    ],
)
def test_admin_pages_need_no_inline_script(operator, path):
    QueuePolicy.objects.get_or_create(pk=1)
    browser = Client()
    browser.force_login(operator)
    page = browser.get(path)
    assert page.status_code == 200
    inline = [tag for tag in re.findall(rb"<script[^>]*>", page.content) if b" src=" not in tag]
    assert inline == [], inline
