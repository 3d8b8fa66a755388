"""Who may see and cancel jobs, and which permission each job type needs: the job rules of
telemachus/teams/rbac.py, kept with the Job model they read."""

from django.db.models import Q, QuerySet
from guardian.shortcuts import get_objects_for_user

from scheduler.models import Job
from telemachus.errors import Forbidden
from telemachus.models import Membership
from telemachus.teams.rbac import CHAT, FLOWS, TOOLS, Principal, is_operator, team_role

JOB_TYPE_PERMISSION: dict[str, str] = {
    Job.Type.CHAT: CHAT,
    Job.Type.TRANSLATE: CHAT,
    Job.Type.TOOL: TOOLS,
    Job.Type.FLOW: FLOWS,
    Job.Type.TASK: FLOWS,
    Job.Type.GOVERNED: FLOWS,
}


def visible_jobs(user: Principal) -> QuerySet[Job]:
    """Lists and detail views filter through this, so a list can never show a job its detail
    would hide: own jobs in a team one is still in, every job of a team one manages, and jobs
    shared through guardian's `scheduler.view_job`."""
    if is_operator(user):
        return Job.objects.all()
    if not user.is_authenticated or not user.is_active:
        return Job.objects.none()
    memberships = Membership.objects.filter(user=user)
    shared = get_objects_for_user(
        user, "scheduler.view_job", klass=Job, accept_global_perms=False, with_superuser=False
    ).values("pk")
    return Job.objects.filter(
        Q(team__in=memberships.filter(role=Membership.Role.MANAGER).values("team"))
        | Q(user=user, team__in=memberships.values("team"))
        | Q(pk__in=shared)
    )


def require_cancel(user: Principal, job: Job) -> None:
    """Cancel a job one can see: its owner, a manager of its team, an operator, or a holder of
    guardian's `scheduler.change_job` on it."""
    if is_operator(user) or job.user_id == user.pk or team_role(user, job.team) == Membership.Role.MANAGER:
        return
    if user.has_perm("scheduler.change_job", job):
        return
    raise Forbidden(
        "Only the job's owner, a manager of its team or an operator may cancel it.", permission="job:cancel"
    )
