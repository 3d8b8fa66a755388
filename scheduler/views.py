"""The live dashboard page, for operators and team members; its data comes over /ws/dashboard/."""

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render


@login_required
def dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "scheduler/dashboard.html")
