"""The dashboard's charts and key figures in a real browser: Playwright drives Debian's chromium
against the API server, over a history written before the browser starts (no worker runs, so
nothing else moves it).

Given three recorded buckets (20 minutes each, so the open one outlasts the test): a queue of 40
in the middle one, jobs that waited 0.01 s in the last one with a spend of 0.0004, then, in the
open bucket, three jobs that started after waiting 4.9 s and one still queued for 5 s. The page
draws the 40 as a level across its bucket (not a ramp from the bucket before), its wait tile says
4.9 s, as the wait chart's live edge does, and how long the queued job has waited, its spend tile
says 0.0004 as the spend chart does, and each policy setting says what it does."""

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from scheduler.live.snapshot import POLICY_HELP
from scheduler.models import Job, JobEvent, QueueSample
from scheduler.services.history import bucket_start
from scheduler.services.submit import job_submit
from tests.browser.test_dashboard_browser import CHROMIUM, FLAGS, sync_api
from tests.processes import wait_until

BUCKET = 1200  # seconds

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"),
    pytest.mark.django_db(transaction=True),
]

# Every uPlot the page makes, kept where the test can read what it drew (the page keeps them to itself).
KEEP_PLOTS = """
window.plots = [];
let made;
Object.defineProperty(window, "uPlot", {
  configurable: true,
  get() { return made; },
  set(real) {
    made = class extends real {
      constructor(...args) { super(...args); window.plots.push(this); }
    };
  },
});
"""

# Where the team's line crosses the middle of the step that holds its peak, in canvas pixels,
# beside where the peak and half of it would be.
CROSSING = """(chart) => {
  const u = window.plots.find((p) => p.root.isConnected && p.root.closest(`#chart-${chart}`));
  const [xs, ys] = u.data;
  const i = ys.indexOf(Math.max(...ys.filter((v) => v !== null)));
  const x = Math.round(u.valToPos((xs[i - 1] + xs[i]) / 2, "x", true));
  const column = u.ctx.getImageData(x, 0, 1, u.ctx.canvas.height).data;
  const [r, g, b] = [0x1f, 0x5f, 0xd6];  // the first team's colour
  const hits = [];
  for (let y = 0; y < column.length / 4; y++) {
    const [R, G, B, A] = column.slice(4 * y, 4 * y + 4);
    if (A > 128 && Math.abs(R - r) + Math.abs(G - g) + Math.abs(B - b) < 90) hits.push(y);
  }
  return { hits, peak: u.valToPos(ys[i], "y", true), half: u.valToPos(ys[i] / 2, "y", true), value: ys[i] };
}"""


@pytest.fixture
def history(processes, make_user, make_team, make_executor, settings):
    settings.TELEMACHUS_HISTORY_BUCKET_SECONDS = BUCKET

    def room_left() -> bool:
        """The open bucket began at least 2 s ago (the 4.9 s waits end in it) and lasts past the test."""
        now = timezone.now()
        return timedelta(seconds=2) <= now - bucket_start(now) <= timedelta(seconds=BUCKET - 90)

    wait_until(room_left, timeout=100, what="a bucket with room for the test")
    User = get_user_model()
    User.objects.create_superuser("root", "root@example.com", "operator pass 1")
    alice = make_user("alice")
    team = make_team("a", {alice: "member"})
    make_executor("shared", models=["m"])
    now = timezone.now()
    open_bucket = bucket_start(now)
    first, burst, last = (open_bucket - n * timedelta(seconds=BUCKET) for n in (3, 2, 1))
    QueueSample.objects.create(at=first, values={"queued": 0, "running": 0, "in_use": 0})
    QueueSample.objects.create(at=burst, values={"queued": 40, "running": 4, "in_use": 4})
    QueueSample.objects.create(at=burst, team=team, values={"queued": 40, "running": 4, "in_use": 4})
    quick = {"started": 3, "finished": 3, "wait_p50": 0.01, "wait_p95": 0.01, "tokens": 30, "cost": 0.0004}
    QueueSample.objects.create(at=last, values={"queued": 0, "running": 0, "in_use": 0, **quick})
    QueueSample.objects.create(at=last, team=team, values=quick)
    for _ in range(3):
        started = now - timedelta(seconds=1)
        job = Job.objects.create(
            type="chat",
            user=alice,
            team=team,
            model="m",
            status=Job.Status.DONE,
            submitted_at=started - timedelta(seconds=4.9),
            started_at=started,
            finished_at=now,
        )
        JobEvent.objects.create(job=job, event=JobEvent.Type.STARTED, at=started)
    waiting = job_submit(
        user=alice,
        team="a",
        type="chat",
        requirements={"model": "m"},
        input={"messages": [{"role": "user", "content": "x"}]},
    )
    Job.objects.filter(pk=waiting.pk).update(queued_at=now - timedelta(seconds=5))
    return processes.api_server(TELEMACHUS_HISTORY_BUCKET_SECONDS=str(BUCKET))


def test_charts_draw_each_bucket_across_it_and_the_tiles_say_what_the_charts_do(history):
    base = history
    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            context.add_init_script(KEEP_PLOTS)
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(base + "/dashboard/")
            page.fill("#id_username", "root")
            page.fill("#id_password", "operator pass 1")
            page.click("button[type=submit]")
            sync_api.expect(page.locator("#status")).to_contain_text("live", timeout=15_000)

            # The queue of 40: the chart's highest point, level across its whole bucket.
            sync_api.expect(page.locator("#chart-queued")).to_have_attribute("data-max", "40")
            crossing = page.evaluate(CROSSING, "queued")
            assert crossing["value"] == 40 and crossing["hits"], crossing
            assert all(abs(y - crossing["peak"]) <= 3 for y in crossing["hits"]), (
                f"mid-bucket the line is not at the bucket's value (a ramp at {crossing['half']:.0f}?): {crossing}"
            )

            # Queue wait: the open bucket's 4.9 s, as the wait chart's live edge shows it, and the
            # job still queued; not the 0.01 s of the last bucket recorded.
            wait = page.locator("#kpi-wait")
            sync_api.expect(wait.locator(".value")).to_have_text("4.9 s")
            sync_api.expect(wait).to_contain_text("3 started since")
            queued = page.locator("#kpi-wait-queued")
            sync_api.expect(queued).to_have_text(re.compile(r"queued now: longest \d+(\.\d)? s"))
            assert float(queued.inner_text().split()[-2]) >= 5
            legend_p95 = page.locator("#chart-wait .u-series").nth(2).locator(".u-value")
            sync_api.expect(legend_p95).to_have_text("4.9 s")

            # Spend: the tile has the digits the chart has.
            sync_api.expect(page.locator("#chart-cost .u-series").nth(1).locator(".u-value")).to_have_text("0.0004")
            sync_api.expect(page.locator("#kpi-tokens .sub")).to_have_text("last 1 h · spend 0.0004 USD")

            # Each policy setting says what it does, beside its field and as its description.
            for name, text in POLICY_HELP.items():
                sync_api.expect(page.locator(f"#help-{name}")).to_have_text(text)
                sync_api.expect(page.get_by_label(name, exact=True)).to_have_accessible_description(text)
        finally:
            browser.close()
    assert errors == []
