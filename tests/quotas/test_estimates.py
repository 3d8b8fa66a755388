"""A job without `est_tokens` reserves a real estimate (its prompt's tokens plus max_tokens, or the
model's expected completion), so a budget holds for it exactly as for jobs that give one."""

import pytest
from django.db import connection
from django.db.models import Sum

from executors.models import Executor
from quotas.models import QuotaPolicy, Usage
from scheduler.models import Job, Slot
from scheduler.services.claim import job_claim
from scheduler.services.rounds import round_finish, round_requeue
from scheduler.services.submit import job_submit
from tests.conftest import chat_body
from tests.processes import wait_until
from tests.scheduler.services.test_rounds import calling, echoed

# "hello": 4 tokens of role framing and 1 word.
PROMPT = 5


def no_estimate(team: str = "a", **input_extra) -> dict:
    body = chat_body(team, requirements={"model": "m"})
    body["input"] = {"messages": [{"role": "user", "content": "hello"}], **input_extra}
    return body


@pytest.mark.django_db
class TestEstimates:
    def test_prompt_plus_max_tokens(self, api, member_setup):
        response = api(member_setup[0]).post("/api/jobs/", no_estimate(max_tokens=16), format="json")
        assert response.status_code == 201, response.content
        assert Job.objects.get().cost_estimate == PROMPT + 16
        assert "est_tokens" not in response.json()["requirements"]

    def test_without_max_tokens_the_models_expected_completion(self, api, member_setup, make_executor, settings):
        make_executor("big", models=["big"])
        settings.TELEMACHUS_COMPLETION_ESTIMATE, settings.TELEMACHUS_COMPLETION_ESTIMATES = 300, {"big": 4000}
        client = api(member_setup[0])
        assert client.post("/api/jobs/", no_estimate(), format="json").status_code == 201
        other = no_estimate()
        other["requirements"]["model"] = "big"
        assert client.post("/api/jobs/", other, format="json").status_code == 201
        assert list(Job.objects.order_by("pk").values_list("cost_estimate", flat=True)) == [PROMPT + 300, PROMPT + 4000]

    @pytest.mark.parametrize("given, expected", [(0, PROMPT + 16), (3, PROMPT + 16), (500, 500)])
    def test_a_given_estimate_may_raise_the_requests_cost_never_lower_it(self, api, member_setup, given, expected):
        body = no_estimate(max_tokens=16)
        body["requirements"]["est_tokens"] = given
        assert api(member_setup[0]).post("/api/jobs/", body, format="json").status_code == 201
        job = Job.objects.get()
        assert job.cost_estimate == expected
        # The money reserved follows: the completion priced is max_tokens, the prompt its tokens.
        assert (job.est_prompt_tokens, job.est_completion_tokens) == (PROMPT, 16)

    def test_an_estimate_of_zero_cannot_lower_a_flows_rounds(self, member_setup, settings):
        settings.TELEMACHUS_COMPLETION_ESTIMATE = 50
        flow = job_submit(
            user=member_setup[0],
            team="a",
            type="flow",
            requirements={"model": "m", "est_tokens": 0},
            input={"messages": [{"role": "user", "content": "go [rounds:3]"}], "tools": ["echo"]},
        )
        assert Job.objects.get(pk=flow.pk).cost_estimate == 4 + 2 + 50

    def test_translate_counts_its_template_and_tools_tasks_use_nothing(self, api, member_setup, settings):
        settings.TELEMACHUS_COMPLETION_ESTIMATE = 100
        client = api(member_setup[0])
        translate = {
            "type": "translate",
            "team": "a",
            "requirements": {"model": "m"},
            "input": {"text": "good morning", "target_lang": "French"},
        }
        tool = {"type": "tool", "team": "a", "input": {"tool": "echo", "arguments": {}}}
        assert client.post("/api/jobs/", translate, format="json").status_code == 201
        assert client.post("/api/jobs/", tool, format="json").status_code == 201
        translated, tooled = Job.objects.order_by("pk")
        assert translated.cost_estimate > 100 + 4 + 2, "the system template and the text, and the completion"
        assert tooled.cost_estimate == 0

    def test_a_budget_refuses_a_job_without_an_estimate_it_cannot_cover(self, api, member_setup):
        QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=20, window="day")
        response = api(member_setup[0]).post("/api/jobs/", no_estimate(max_tokens=16), format="json")
        assert response.status_code == 429 and response.json()["error"] == "quota_exceeded"

    def test_a_flows_next_round_reserves_the_conversation_so_far(self, member_setup, settings):
        settings.TELEMACHUS_COMPLETION_ESTIMATE = 50
        flow = job_submit(
            user=member_setup[0],
            team="a",
            type="flow",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "go [rounds:3]"}], "tools": ["echo"]},
        )
        first = Job.objects.get(pk=flow.pk).cost_estimate
        assert first == 4 + 2 + 50
        (claim,) = job_claim(worker="w", limit=1).claims  # the claim starts round 1
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1))
        round_requeue(job_id=flow.pk, lease=claim.lease, round=1, results=[echoed(1)])
        # The assistant's call (4, no text) and the tool's answer (4 + 2 words) join the prompt.
        assert Job.objects.get(pk=flow.pk).cost_estimate == first + 4 + 4 + 2


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("given", [None, 0], ids=["no estimate", "an estimate of 0"])
def test_a_daily_budget_of_100_holds_for_30_bulk_jobs_without_estimates(api, member_setup, processes, given):
    # Given a 100-token daily budget for team a, and 30 jobs (max_tokens 16, no est_tokens, or 0,
    # which once reserved nothing: 80x the budget was billed) in one bulk...
    alice, *_, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(max_concurrency=8, meta={"latency_ms": 50, "output_tokens": 16})
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=100, window="day")
    client = api(alice)
    body = no_estimate(max_tokens=16)
    if given is not None:
        body["requirements"]["est_tokens"] = given
    response = client.post("/api/jobs/bulk/", {"jobs": [body] * 30}, format="json")
    assert response.status_code == 201, response.content

    # When a worker runs what the budget allows...
    processes.worker("w", concurrency=8)
    wait_until(lambda: Job.objects.filter(status="done").count() >= 4, timeout=60, what="four jobs to finish")
    wait_until(lambda: not Slot.objects.exists(), timeout=30, what="the running jobs to finish")

    # Then it never bills past the budget: four jobs of 21 tokens fit, the fifth would not...
    billed = Usage.objects.filter(scope="team", subject="a").aggregate(tokens=Sum("tokens"))["tokens"]
    assert billed == 4 * (PROMPT + 16) <= 100
    assert Job.objects.filter(status="done").count() == 4 and Job.objects.filter(status="queued").count() == 26
    # ...and once the budget is reserved or spent, a further job is refused at submit.
    refused = client.post("/api/jobs/", no_estimate(max_tokens=16), format="json")
    assert refused.status_code == 429 and refused.json()["error"] == "quota_exceeded"
    connection.close()
