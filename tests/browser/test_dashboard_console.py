"""The dashboard as an operator's console under load, in a real browser: Playwright drives Debian's
chromium against the API server and a real worker running a 200-job burst on simulated executors.

Given two teams' burst (and an idle third team), the operator filters the job list to running
jobs and cancels one from the page; pages through every job; opens a job's details; sees the
charts fill from the history the worker records; and, on a phone-sized screen (390 px), finds a
page no wider than the screen, where an invalid capacity is refused in words beside the field.
Screenshots of the busy dashboard at 1,400 and 390 px are kept in var/artifacts/ (CI prints them).
Any JavaScript console error (a Content-Security-Policy refusal included) fails the test."""

import json
import re
import urllib.request

import pytest
from django.contrib.auth import get_user_model

from tests.browser.test_dashboard_browser import CHROMIUM, FLAGS, api_get, sync_api
from tests.credentials import token_for
from tests.processes import ROOT, wait_until

ARTIFACTS = ROOT / "var" / "artifacts"
BUCKET = "1"  # seconds per history bucket, so the charts fill within the test

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"),
    pytest.mark.django_db(transaction=True),
]


def api_post(base: str, token: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def burst(team: str, n: int) -> dict:
    job = {
        "type": "chat",
        "team": team,
        "requirements": {"model": "m", "est_tokens": 50},
        "input": {"messages": [{"role": "user", "content": "summarise the incident"}], "max_tokens": 64},
    }
    return {"jobs": [job] * n}


@pytest.fixture
def busy(processes, make_user, make_team, make_executor):
    """Given teams a and b with 120 and 80 jobs queued at once, an idle team c, two sim executors
    (4 and 2 slots, a few seconds per call) and one disabled one, a worker and the API server."""
    User = get_user_model()
    User.objects.create_superuser("root", "root@example.com", "operator pass 1")
    alice, bob = make_user("alice"), make_user("bob")
    make_team("a", {alice: "member"})
    make_team("b", {bob: "member"})
    make_team("c")
    knobs = {"latency_ms": 3000, "jitter_ms": 1500, "output_tokens": 48}
    make_executor("gpu-1", models=["m"], max_concurrency=4, meta=knobs)
    make_executor("gpu-2", models=["m"], max_concurrency=2, meta=knobs)
    make_executor("spare", models=["m"], max_concurrency=2, enabled=False, meta=knobs)
    tokens = {u.username: token_for(u) for u in User.objects.all()}
    env = {"TELEMACHUS_HISTORY_BUCKET_SECONDS": BUCKET}
    base = processes.api_server(**env)
    processes.worker("w1", concurrency=16, **env)
    api_post(base, tokens["alice"], "/api/jobs/bulk/", burst("a", 120))
    api_post(base, tokens["bob"], "/api/jobs/bulk/", burst("b", 80))
    return base, tokens


def open_dashboard(browser, base: str, width: int, height: int, errors: list[str]):
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.on("console", lambda m: errors.append(f"{width}px: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"{width}px: {e}"))
    page.goto(base + "/dashboard/")
    page.fill("#id_username", "root")
    page.fill("#id_password", "operator pass 1")
    page.click("button[type=submit]")
    sync_api.expect(page.locator("#status")).to_contain_text("live", timeout=15_000)
    return page


def row_ids(table) -> list[int]:
    return [int(key) for key in table.locator("tbody tr").evaluate_all("rows => rows.map(r => r.dataset.key)")]


def chart_values(page, chart: str) -> int:
    return int(page.locator(f"#chart-{chart}").get_attribute("data-nonzero") or 0)


def test_a_burst_seen_and_handled_from_the_console(busy):
    base, tokens = busy
    root = tokens["root"]
    errors: list[str] = []
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        try:
            page = open_dashboard(browser, base, 1400, 900, errors)
            jobs = page.locator("#jobs")

            # Running jobs come first on the default tab, Cancel buttons and all, though 200 are queued.
            sync_api.expect(jobs.locator("tbody tr").first).to_contain_text("running", timeout=20_000)

            # Filter to running jobs and cancel one from the page.
            page.get_by_role("tab", name="Running").click()
            sync_api.expect(page.locator("#tab-running")).to_have_attribute("aria-selected", "true")
            wait_until(
                lambda: set(jobs.locator("tbody td:nth-child(2)").all_inner_texts()) == {"running"},
                timeout=10,
                what="a list of running jobs only",
            )
            victim = int(jobs.locator("tbody tr").first.get_attribute("data-key"))
            page.get_by_label(f"cancel job {victim}", exact=True).click()
            sync_api.expect(page.locator("#notice")).to_have_text(f"cancel job {victim}: done")
            assert api_get(base, root, f"/api/jobs/{victim}/")["status"] == "canceled"
            sync_api.expect(jobs.locator(f'tr[data-key="{victim}"]')).to_have_count(0)

            # Narrow by team: only team b's jobs, and the tab counts follow.
            page.get_by_role("tab", name="All").click()
            page.get_by_label("filter by team").select_option("b")
            wait_until(
                lambda: set(jobs.locator("tbody td:nth-child(3)").all_inner_texts()) == {"b"},
                timeout=10,
                what="team b's jobs only",
            )
            page.get_by_label("filter by team").select_option("")
            sync_api.expect(jobs).not_to_have_class(re.compile("loading"))

            # Page through them: the second page of queued jobs starts where the first ended (a
            # queued job only leaves the queue, so no job can show on both).
            page.get_by_role("tab", name="Queued").click()
            sync_api.expect(jobs).not_to_have_class(re.compile("loading"))
            first_page = row_ids(jobs)
            assert len(first_page) == 50 and first_page == sorted(first_page, reverse=True)
            page.get_by_role("button", name="Older →").click()
            sync_api.expect(page.locator("#job-pager")).to_contain_text("51–100 of")
            sync_api.expect(jobs).not_to_have_class(re.compile("loading"))
            second_page = row_ids(jobs)
            assert len(second_page) == 50 and max(second_page) < min(first_page)
            page.get_by_role("button", name="← Newer").click()
            sync_api.expect(page.locator("#job-pager")).to_contain_text("1–50 of")

            # A job's details without leaving the page: its fields, events and input.
            page.get_by_label(f"details of job {first_page[0]}", exact=True).click()
            detail = page.locator("#job-detail")
            sync_api.expect(detail).to_be_visible()
            sync_api.expect(detail).to_contain_text("Events")
            sync_api.expect(detail).to_contain_text("summarise the incident")
            page.get_by_label("close job details").click()
            sync_api.expect(detail).to_be_hidden()
            page.get_by_role("tab", name="All").click()

            # The idle team is shown as idle, with the share it would get.
            sync_api.expect(page.locator("#teams")).to_contain_text("idle · 33.3% if busy")

            # The charts fill from the history the worker records, and stay live.
            for chart in ("queued", "running", "slots", "wait", "tokens", "ended"):
                wait_until(lambda c=chart: chart_values(page, c) > 0, timeout=40, what=f"the {chart} chart to fill")
            # The last 15 minutes, a point every 3 s: wait for a few of them before the picture.
            page.get_by_label("chart range 15 m").click()
            wait_until(
                lambda: int(page.locator("#chart-queued").get_attribute("data-points") or 0) >= 3 * 10,
                timeout=40,
                what="ten points per team in the queued chart",
            )
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(ARTIFACTS / "dashboard-1400.png"), full_page=True)
            page.locator("#jobs tbody a").nth(2).click()
            sync_api.expect(page.locator("#job-detail")).to_contain_text("Events")
            page.screenshot(path=str(ARTIFACTS / "dashboard-1400-details.png"))

            # A phone held upright: nothing wider than the screen; wide tables scroll inside.
            phone = open_dashboard(browser, base, 390, 844, errors)
            sync_api.expect(phone.locator("#jobs tbody tr").first).to_contain_text("running", timeout=10_000)
            wait_until(lambda: chart_values(phone, "queued") > 0, timeout=20, what="the charts on the phone")
            widths = phone.evaluate(
                "[document.documentElement.scrollWidth, document.body.scrollWidth, window.innerWidth]"
            )
            assert widths[0] <= 390 and widths[1] <= 390 and widths[2] == 390, widths

            # An invalid capacity: refused, and the reason in words beside the field, not JSON.
            capacity = phone.get_by_label("capacity of gpu-1", exact=True)
            capacity.fill("-1")
            sync_api.expect(phone.locator("#executors .edit.dirty")).to_have_count(1)
            phone.get_by_label("save capacity of gpu-1", exact=True).click()
            beside = phone.locator("#executors .edit.invalid .field-error")
            sync_api.expect(beside).to_have_text("Ensure this value is greater than or equal to 0.")
            assert "{" not in phone.locator("#notice").inner_text()
            sync_api.expect(phone.locator("#notice")).to_contain_text("capacity of gpu-1: not saved")
            assert api_get(base, root, "/api/executors/?page_size=10")["results"][0]["max_concurrency"] in (2, 4)
            phone.evaluate("window.scrollTo(0, 0)")
            phone.screenshot(path=str(ARTIFACTS / "dashboard-390.png"), full_page=True)
            widths = phone.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
            assert widths[0] <= widths[1], widths
        finally:
            browser.close()
    assert errors == []
    for name in ("dashboard-1400.png", "dashboard-390.png"):
        assert (ARTIFACTS / name).stat().st_size > 20_000
