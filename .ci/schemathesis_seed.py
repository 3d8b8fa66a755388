"""Seed for .ci/schemathesis (run with `manage.py shell`): the demo, a member with a team of their
own and jobs in every state, so schema-driven requests find real objects; prints both tokens."""

from django.contrib.auth import get_user_model
from django.core.management import call_command

from quotas.models import QuotaPolicy
from scheduler.services.cancel import job_cancel
from scheduler.services.claim import job_claim
from scheduler.services.finish import job_finish
from scheduler.services.submit import job_submit
from telemachus.keys.services import personal_token_issue
from telemachus.teams.services import team_create

call_command("telemachus_demo", stdout=open("/dev/null", "w"))
User = get_user_model()
admin = User.objects.get(username="admin")
member = User.objects.filter(username="member").first() or User.objects.create_user("member", password="x-unused-x")
if not member.memberships.exists():
    team_create(
        slug="members",
        name="Members",
        members=[{"username": "member", "role": "manager"}, {"username": "admin", "role": "member"}],
    )
for user, team in ((admin, "demo"), (member, "members"), (member, "members")):
    for _ in range(3):
        job_submit(
            user=user,
            team=team,
            type="chat",
            requirements={"model": "sim", "est_tokens": 10},
            input={"messages": [{"role": "user", "content": "seed"}]},
        )
claims = job_claim(worker="seed", limit=3).claims
job_finish(job_id=claims[0].job.pk, lease=claims[0].lease, result={"seed": True})
job_finish(job_id=claims[1].job.pk, lease=claims[1].lease, error="seeded failure")
job_cancel(job_id=claims[2].job.pk, by=admin)
QuotaPolicy.objects.get_or_create(scope="team", subject="demo", dimension="ai.concurrency", defaults={"limit": 4})
print("OPERATOR_TOKEN", personal_token_issue(user=admin)[1])
print("MEMBER_TOKEN", personal_token_issue(user=member)[1])
