import pytest
from django.utils import timezone

from quotas.budget import Bill, quota_settle
from quotas.models import QuotaPolicy
from scheduler.models import Job
from scheduler.services.cancel import job_cancel
from scheduler.services.claim import job_claim
from scheduler.services.rounds import round_finish
from scheduler.services.submit import job_submit

pytestmark = pytest.mark.django_db

PAGES = [
    "/admin/",
    "/admin/telemachus/team/",
    "/admin/telemachus/membership/",
    "/admin/executors/executor/",
    "/admin/quotas/quotapolicy/",
    "/admin/quotas/usage/",
    "/admin/scheduler/job/",
    "/admin/scheduler/jobevent/",
    "/admin/scheduler/slot/",
    "/admin/scheduler/queuepolicy/",
]


@pytest.fixture
def admin_client_with_data(client, operator, member_setup):
    job_submit(user=member_setup[0], team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
    client.force_login(operator)
    return client


@pytest.mark.parametrize("page", PAGES)
def test_changelists_render(admin_client_with_data, page):
    response = admin_client_with_data.get(page)
    assert response.status_code == 200


def test_job_detail_renders_events(admin_client_with_data):
    job = Job.objects.get()
    response = admin_client_with_data.get(f"/admin/scheduler/job/{job.pk}/change/")
    assert response.status_code == 200
    assert b"queued" in response.content


def test_cancel_action_uses_the_service(admin_client_with_data):
    job = Job.objects.get()
    response = admin_client_with_data.post(
        "/admin/scheduler/job/", {"action": "cancel", "_selected_action": [job.pk]}, follow=True
    )
    assert response.status_code == 200
    job.refresh_from_db()
    assert job.status == "canceled"
    assert list(job.events.values_list("event", flat=True)) == ["queued", "canceled"]


def test_job_events_are_read_only(admin_client_with_data):
    response = admin_client_with_data.get("/admin/scheduler/jobevent/add/")
    assert response.status_code == 403


def test_team_created_in_admin_gets_a_group(admin_client_with_data, make_user):
    carol = make_user("carol")
    response = admin_client_with_data.post(
        "/admin/telemachus/team/add/",
        {
            "slug": "ops",
            "name": "Ops",
            "memberships-TOTAL_FORMS": "1",
            "memberships-INITIAL_FORMS": "0",
            "memberships-0-user": carol.pk,
            "memberships-0-role": "manager",
        },
    )
    assert response.status_code == 302, response.content[:2000]
    from telemachus.models import Team

    team = Team.objects.get(slug="ops")
    assert team.group.name == "team:ops"
    assert carol.groups.filter(pk=team.group_id).exists()
    assert team.memberships.get().role == "manager"


def test_budget_rules_show_their_usage(admin_client_with_data, member_setup):
    alice, _, team_a, _, _ = member_setup
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=1000, window="day")
    quota_settle(
        reservations=[],
        bills=[Bill(team_id=team_a.pk, user_id=alice.pk, executor_id=None, tokens=300)],
        now=timezone.now(),
    )
    page = admin_client_with_data.get("/admin/quotas/quotapolicy/").content.decode()
    assert "300 (+0)" in page and ">700<" in page and " UTC" in page


def test_requeue_action_uses_the_service(admin_client_with_data):
    job = Job.objects.get()
    job_cancel(job_id=job.pk)
    response = admin_client_with_data.post(
        "/admin/scheduler/job/", {"action": "requeue", "_selected_action": [job.pk]}, follow=True
    )
    assert b"Requeued 1 job(s)." in response.content
    job.refresh_from_db()
    assert job.status == "queued" and job.events.last().meta["was"] == "canceled"


def test_a_running_flow_shows_its_round(admin_client_with_data, member_setup):
    Job.objects.all().delete()
    flow = job_submit(
        user=member_setup[0],
        team="a",
        type="flow",
        requirements={"model": "m"},
        input={"messages": [{"role": "user", "content": "go"}], "tools": ["echo"]},
    )
    (claim,) = job_claim(worker="w", limit=1).claims  # the claim starts round 1 (round_started)
    page = admin_client_with_data.get("/admin/scheduler/job/").content.decode()
    assert "round 1" in page
    round_finish(job_id=flow.pk, lease=claim.lease, round=1, message={"role": "assistant", "content": "ok"})
    page = admin_client_with_data.get(f"/admin/scheduler/job/{flow.pk}/change/").content.decode()
    assert "round_started" in page and "round_finished" in page
    assert "1 round" in admin_client_with_data.get("/admin/scheduler/job/").content.decode()
