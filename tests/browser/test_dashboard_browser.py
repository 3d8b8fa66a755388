"""The dashboard in a real browser: Playwright drives Debian's chromium (/usr/bin/chromium, installed
by .ci/run; never a downloaded browser) against the real ASGI app, served as bin/run serves it.

An operator signs in, changes a team's weight and an executor's capacity on the page, and the API
and the audit log show the changes; a member's page has no controls and its socket refuses an
action. A screenshot is kept as a CI artifact; any JavaScript console error fails the test.

Everything the test needs from the database is set up before the browser starts; afterwards it
only speaks HTTP, as a person and their scripts would (Playwright's sync API runs an event loop,
where Django refuses ORM calls)."""

import json
import re
import threading
import urllib.request
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from telemachus.teams.services import team_create, team_member_set
from tests.credentials import token_for
from tests.processes import ROOT, answers, free_port, wait_until

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACT = ROOT / "var" / "artifacts" / "dashboard.png"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (.ci/run installs it: apt-get install -y chromium)",
    ),
    pytest.mark.django_db(transaction=True),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (the dev extra)")


def api_get(base: str, token: str, path: str) -> dict:
    request = urllib.request.Request(base + path, headers={"Authorization": f"Token {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def server(processes, make_executor):
    User = get_user_model()
    User.objects.create_superuser("root", "root@example.com", "operator pass 1")
    User.objects.create_user("alice", password="member pass 1")
    team_member_set(team=team_create(slug="a", name="Team A"), username="alice", role="member")
    team_create(slug="b", name="Team B")
    executor = make_executor("shared", models=["m"])
    token = token_for(User.objects.get(username="root"))
    port = free_port()
    processes.spawn("api", "-m", "telemachus.serve", "127.0.0.1", str(port))
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: answers(base + "/healthz"), timeout=30, what="the API to listen")
    return base, token, executor.pk


def sign_in(browser, base: str, username: str, password: str, errors: list[str]):
    context = browser.new_context(viewport={"width": 1500, "height": 1100})
    page = context.new_page()
    page.on(
        "console", lambda message: errors.append(f"{username}: {message.text}") if message.type == "error" else None
    )
    page.on("pageerror", lambda error: errors.append(f"{username}: {error}"))
    page.goto(base + "/dashboard/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    sync_api.expect(page.locator("#status")).to_contain_text("live", timeout=15_000)
    return page


def test_operators_act_on_the_dashboard_and_members_only_watch(server):
    base, token, executor_id = server
    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        try:
            page = sign_in(browser, base, "root", "operator pass 1", errors)

            page.get_by_label("weight of a", exact=True).fill("3")
            page.get_by_label("save weight of a", exact=True).click()
            sync_api.expect(page.locator("#notice")).to_have_text("weight of a: done")
            wait_until(
                lambda: api_get(base, token, "/api/policy/")["team_weights"] == {"a": 3.0},
                timeout=10,
                what="the weight in /api/policy/",
            )

            page.get_by_label("capacity of shared", exact=True).fill("9")
            page.get_by_label("save capacity of shared", exact=True).click()
            sync_api.expect(page.locator("#notice")).to_have_text("capacity of shared: done")
            wait_until(
                lambda: api_get(base, token, f"/api/executors/{executor_id}/")["max_concurrency"] == 9,
                timeout=10,
                what="the capacity in /api/executors/",
            )
            # The page shows what the server now holds, pushed back to it.
            sync_api.expect(page.locator("#executors")).to_contain_text("0 / 9")

            audit = api_get(base, token, "/api/audit/?actor=root")["results"]
            assert [(e["action"], e["source"], e["after"]) for e in audit] == [
                ("executor.update", "dashboard", {"max_concurrency": 9}),
                ("queue_policy.update", "dashboard", {"team_weights": {"a": 3.0}}),
            ]
            ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACT), full_page=True)

            member = sign_in(browser, base, "alice", "member pass 1", errors)
            sync_api.expect(member.locator("#teams")).to_contain_text("a")
            # No controls that change anything: the job list's tabs, filters and pager and the
            # charts' range only choose what this page shows.
            acting = ":is(#teams, #executors, #users, #jobs, #policy, #policy-actions, #features, #job-detail)"
            assert member.locator(f"{acting} :is(input, select, textarea, button)").count() == 0
            assert member.get_by_role("button", name=re.compile("save|cancel|requeue", re.I)).count() == 0
            reply = member.evaluate("""() => new Promise((resolve, reject) => {
                const socket = new WebSocket(`ws://${location.host}/ws/dashboard/`);
                socket.addEventListener("message", (message) => {
                    const data = JSON.parse(message.data);
                    if (data.reply !== undefined) { resolve(data); socket.close(); }
                    else if (data.state) socket.send(JSON.stringify(
                        {id: "x", action: "policy.update", changes: {team_weights: {a: 100}}}));
                });
                socket.addEventListener("error", () => reject(new Error("socket error")));
            })""")
            assert reply["ok"] is False and reply["error"]["error"] == "forbidden"
            assert api_get(base, token, "/api/policy/")["team_weights"] == {"a": 3.0}
        finally:
            browser.close()
    assert ARTIFACT.stat().st_size > 10_000
    assert errors == []


def test_live_updates_leave_a_field_being_edited_alone(server):
    """An operator types slowly into a capacity and into the policy's JSON while updates keep
    arriving (a member's script submits a job every 150 ms): what they type, where the caret is
    and the focus survive every push, and the rest of the page still updates."""
    base, token, executor_id = server
    member_token = token_for(get_user_model().objects.get(username="alice"))
    errors: list[str] = []
    stop = threading.Event()

    def submit_forever() -> None:
        body = json.dumps(
            {
                "type": "chat",
                "team": "a",
                "requirements": {"model": "m"},
                "input": {"messages": [{"role": "user", "content": "hi"}]},
            }
        ).encode()
        while not stop.wait(0.15):
            request = urllib.request.Request(
                base + "/api/jobs/",
                data=body,
                method="POST",
                headers={"Authorization": f"Token {member_token}", "Content-Type": "application/json"},
            )
            urllib.request.urlopen(request, timeout=10).close()

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        submitter = threading.Thread(target=submit_forever, daemon=True)
        try:
            page = sign_in(browser, base, "root", "operator pass 1", errors)
            submitter.start()
            capacity = page.get_by_label("capacity of shared", exact=True)
            capacity.click()
            capacity.press("Control+a")
            before = page.evaluate("document.body.dataset.updated")
            capacity.press_sequentially("-12", delay=350)
            assert page.evaluate("document.body.dataset.updated") != before, "no update arrived while typing"
            assert capacity.input_value() == "-12"
            assert page.evaluate("document.activeElement.getAttribute('aria-label')") == "capacity of shared"

            priorities = page.get_by_label("priority_map", exact=True)
            priorities.click()
            priorities.press("Control+a")
            priorities.press_sequentially('{"member": 9}', delay=150)
            for _ in range(2):  # the caret before the 9, where it must stay while updates arrive
                priorities.press("ArrowLeft")
            page.wait_for_timeout(600)
            priorities.press_sequentially("4", delay=350)
            assert priorities.input_value() == '{"member": 49}'
            # Away from the field, the unsaved edit still stands while updates go on.
            page.locator("#jobs").click()
            shown = page.locator("#jobs-count").inner_text()
            wait_until(lambda: page.locator("#jobs-count").inner_text() != shown, timeout=10, what="another update")
            assert priorities.input_value() == '{"member": 49}' and capacity.input_value() == "-12"

            # Saved, the field shows the server's value again.
            capacity.fill("7")
            page.get_by_label("save capacity of shared", exact=True).click()
            sync_api.expect(page.locator("#executors")).to_contain_text("0 / 7")
            page.get_by_label("save queue policy", exact=True).click()
            sync_api.expect(page.locator("#notice")).to_have_text("queue policy: done")
            assert api_get(base, token, "/api/policy/")["priority_map"] == {"member": 49}
        finally:
            stop.set()
            if submitter.is_alive():
                submitter.join(timeout=10)
            browser.close()
    assert errors == []
