"""Executors whose stored JSON has the wrong shape (written around the API and the admin) cannot
crash a claim or the queue page: they are read as offering nothing, and said so in the log."""

import logging

import pytest

from executors.models import Executor
from scheduler.services.claim import job_claim
from scheduler.services.submit import job_submit

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "broken",
    [
        {"capabilities": ["m"]},
        {"capabilities": {"models": "m"}},
        {"capabilities": {"models": [1, None]}},
        {"transport": "x"},
        {"meta": [1]},
    ],
)
def test_a_broken_executor_cannot_stop_the_others(api, operator, member_setup, make_executor, caplog, broken):
    # Given a healthy executor, and a broken one that once offered the model...
    alice = member_setup[0]
    job = job_submit(
        user=alice,
        team="a",
        type="chat",
        requirements={"model": "m"},
        input={"messages": [{"role": "user", "content": "hi"}]},
    )
    make_executor("broken", models=["m"])
    Executor.objects.filter(name="shared").update(enabled=False)
    Executor.objects.filter(name="broken").update(**broken)
    make_executor("healthy", models=["m"])
    caplog.set_level(logging.ERROR, logger="telemachus.executors")

    # When the queue is looked at and a worker claims...
    assert api(operator).get("/api/queue/").status_code == 200
    assert api(operator).get("/api/executors/").status_code == 200
    claims = job_claim(worker="w", limit=1).claims

    # Then the job runs on the healthy one, and the broken value was reported.
    assert [c.job.pk for c in claims] == [job.pk]
    assert claims[0].executor.name in {"healthy", "broken"} - ({"broken"} if "capabilities" in broken else set())
    assert any("executor broken: stored" in r.getMessage() for r in caplog.records)


def test_the_admin_refuses_the_wrong_shapes(client, operator, make_executor):
    executor = make_executor("e1")
    client.force_login(operator)
    page = client.get(f"/admin/executors/executor/{executor.pk}/change/")
    form = page.context["adminform"].form
    data = {name: form.initial.get(name) for name in form.fields}
    data.update({"capabilities": '["m"]', "transport": "{}", "meta": "{}"})
    data = {k: ("" if v is None else v) for k, v in data.items()}
    response = client.post(f"/admin/executors/executor/{executor.pk}/change/", data)
    assert response.status_code == 200 and "capabilities" in response.context["adminform"].form.errors
    assert Executor.objects.get(pk=executor.pk).capabilities == {"models": ["m"]}
