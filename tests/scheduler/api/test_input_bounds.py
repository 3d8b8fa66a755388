"""Integers the API stores have upper bounds, the same as the OpenAI-compatible endpoint's: one past
the bound is a 400 naming the field (it was a 500 where it overflowed an estimate), the bound
itself is accepted."""

import pytest

from executors.models import Executor
from scheduler.models import Job
from telemachus.http.bounds import EST_TOKENS_MAX, MAX_TOKENS, MEMORY_MB_MAX
from tests.conftest import chat_body

pytestmark = pytest.mark.django_db


def job_with(where: str, name: str, value: int) -> dict:
    body = chat_body("a")
    if where == "requirements":
        body["requirements"] = {"model": "m", name: value}
    else:
        body["input"] = {**body["input"], name: value}
    return body


FIELDS = [
    ("input", "max_tokens", MAX_TOKENS),
    ("input", "max_completion_tokens", MAX_TOKENS),
    ("requirements", "est_tokens", EST_TOKENS_MAX),
    ("requirements", "memory_mb", MEMORY_MB_MAX),
]


@pytest.mark.parametrize(("where", "name", "bound"), FIELDS)
@pytest.mark.parametrize("excess", [1, 10**20])
def test_a_job_number_past_its_bound_is_a_400_naming_it(api, member_setup, where, name, bound, excess):
    response = api(member_setup[0]).post("/api/jobs/", job_with(where, name, bound + excess), format="json")
    assert response.status_code == 400, response.content
    assert response.json()["error"] == "validation_error"
    assert list(response.json()["fields"][where]) == [name]
    assert not Job.objects.exists()


@pytest.mark.parametrize(("where", "name", "bound"), FIELDS)
def test_the_bound_itself_is_accepted(api, member_setup, where, name, bound):
    if name == "memory_mb":
        Executor.objects.update(capabilities={"models": ["m"], "memory_mb": MEMORY_MB_MAX})
    response = api(member_setup[0]).post("/api/jobs/", job_with(where, name, bound), format="json")
    assert response.status_code == 201, response.content


@pytest.mark.parametrize("memory", [MEMORY_MB_MAX + 1, 10**20])
def test_an_executors_memory_past_its_bound_is_a_400(api, operator, memory):
    body = {"name": "big", "kind": "sim", "capabilities": {"models": ["m"], "memory_mb": memory}}
    response = api(operator).post("/api/executors/", body, format="json")
    assert response.status_code == 400, response.content
    assert list(response.json()["fields"]["capabilities"]) == ["memory_mb"]
    assert not Executor.objects.exists()
