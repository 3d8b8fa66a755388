from django.urls import path

from scheduler.api import views

urlpatterns = [
    path("jobs/", views.JobListCreateApi.as_view(), name="job-list"),
    path("jobs/bulk/", views.JobBulkSubmitApi.as_view(), name="job-bulk"),
    path("jobs/<int:job_id>/", views.JobDetailApi.as_view(), name="job-detail"),
    path("jobs/<int:job_id>/cancel/", views.JobCancelApi.as_view(), name="job-cancel"),
    path("jobs/<int:job_id>/requeue/", views.JobRequeueApi.as_view(), name="job-requeue"),
    path("jobs/<int:job_id>/events/", views.JobEventListApi.as_view(), name="job-events"),
]
