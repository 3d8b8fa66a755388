from collections.abc import Callable

from django import forms
from django.contrib import admin, messages
from django.http import HttpRequest

from scheduler.core.bounds import field_problem
from scheduler.models import Job, JobEvent, QueuePolicy, Slot
from scheduler.rbac import require_cancel, visible_jobs
from scheduler.services.cancel import job_cancel
from scheduler.services.policy import EDITABLE, queue_policy_update
from scheduler.services.requeue import job_requeue
from telemachus.admin import ReadOnlyAdmin
from telemachus.errors import DomainError
from telemachus.teams.rbac import Principal, is_operator


def readable(rows, request: HttpRequest, *, via: str = "pk"):
    """The rows (jobs, or rows of jobs through `via`) of the jobs the API shows the user
    (scheduler/rbac.py, `visible_jobs`): a staff user's `view_job` opens the admin's pages, not
    other teams' prompts and answers, which the API hides from the same user."""
    if is_operator(request.user):
        return rows
    return rows.filter(**{f"{via}__in": visible_jobs(request.user).values("pk")})


class JobEventInline(admin.TabularInline):
    model = JobEvent
    fields = ["at", "event", "executor", "meta"]
    readonly_fields = fields  # type: ignore[assignment]
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    """The jobs the API shows the user, with what the API shows (their input, result and
    conversation): a job outside them is not listed, counted or found, in any team's filter."""

    list_display = [
        "id",
        "type",
        "team",
        "user",
        "priority",
        "status",
        "round",
        "model",
        "executor",
        "attempts",
        "tokens_used",
        "submitted_at",
        "finished_at",
    ]
    list_filter = [
        "status",
        "type",
        ("team", admin.RelatedOnlyFieldListFilter),
        ("executor", admin.RelatedOnlyFieldListFilter),
    ]
    search_fields = ["id", "model", "user__username", "team__slug", "error"]
    list_select_related = ["team", "user", "executor"]
    date_hierarchy = "submitted_at"
    inlines = [JobEventInline]
    actions = ["cancel", "requeue"]

    def get_queryset(self, request: HttpRequest):
        return readable(super().get_queryset(request), request)

    @admin.display(description="round")
    def round(self, job: Job) -> str:
        return job.round_label

    @admin.action(description="Cancel the selected jobs")
    def cancel(self, request: HttpRequest, queryset) -> None:
        def cancel_one(*, job_id: int, by: Principal) -> Job:
            require_cancel(by, Job.objects.get(pk=job_id))  # as the API: owner, team manager, operator
            return job_cancel(job_id=job_id, by=by)

        done = self._each(request, queryset.exclude(status__in=Job.TERMINAL), cancel_one)
        self.message_user(request, f"Canceled {done} job(s).")

    @admin.action(description="Requeue the selected failed or canceled jobs")
    def requeue(self, request: HttpRequest, queryset) -> None:
        done = self._each(request, queryset, job_requeue)
        self.message_user(request, f"Requeued {done} job(s).")

    def _each(self, request: HttpRequest, queryset, service: Callable[..., Job]) -> int:
        """Call the service for each selected job, one transaction each, so one refusal (shown as
        a warning) does not undo the others; the count of those that went through."""
        done = 0
        for job_id in queryset.values_list("pk", flat=True):
            try:
                service(job_id=job_id, by=request.user)
                done += 1
            except DomainError as exc:
                self.message_user(request, f"Job {job_id}: {exc.detail}", messages.WARNING)
        return done


@admin.register(JobEvent)
class JobEventAdmin(ReadOnlyAdmin):
    """Events of the jobs the user may read (job-less executor events: operators only)."""

    list_display = ["id", "at", "event", "job", "executor"]
    list_filter = ["event", ("executor", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["job__id"]
    list_select_related = ["executor"]
    date_hierarchy = "at"

    def get_queryset(self, request: HttpRequest):
        return readable(super().get_queryset(request), request, via="job")


@admin.register(Slot)
class SlotAdmin(ReadOnlyAdmin):
    list_display = ["id", "job", "executor", "team", "user", "worker", "acquired_at", "lease_expires_at"]
    list_filter = [("executor", admin.RelatedOnlyFieldListFilter), ("team", admin.RelatedOnlyFieldListFilter), "worker"]
    search_fields = ["worker", "job__id", "user__username"]
    list_select_related = ["job", "executor", "team", "user"]

    def get_queryset(self, request: HttpRequest):
        return readable(super().get_queryset(request), request, via="job")

    @admin.display(description="lease expires")
    def lease_expires_at(self, slot: Slot):
        return slot.job.lease_expires_at


class QueuePolicyForm(forms.ModelForm):
    """The API's bounds (scheduler/core/bounds.py), so the admin cannot store what the API refuses."""

    class Meta:
        model = QueuePolicy
        fields = EDITABLE

    def clean(self) -> dict:
        cleaned = super().clean()
        for name in self.changed_data:
            if name in cleaned and (problem := field_problem(name, cleaned[name])) is not None:  # type: ignore[index, operator]
                self.add_error(name, f"This value {problem}.")
        return cleaned  # type: ignore[return-value]


@admin.register(QueuePolicy)
class QueuePolicyAdmin(admin.ModelAdmin):
    """Saved through the policy service, so admin edits are audited like API edits."""

    form = QueuePolicyForm
    list_display = ["__str__", "placement", "cost", "half_life_seconds", "recovery", "max_attempts", "updated_at"]
    fields = EDITABLE

    def save_model(self, request: HttpRequest, obj: QueuePolicy, form, change: bool) -> None:
        queue_policy_update(changes={name: form.cleaned_data[name] for name in form.changed_data}, by=request.user)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return not QueuePolicy.objects.exists()

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False
