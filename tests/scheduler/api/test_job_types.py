"""Submitting flow, tool and translate jobs through the API: what each needs, and the 400s that name
what is wrong (unknown tool, missing permission, bounds). Round events in /events/."""

import pytest

from scheduler.models import Job, JobEvent
from scheduler.services.claim import job_claim
from scheduler.services.rounds import round_finish
from tests.conftest import job_body

pytestmark = pytest.mark.django_db


def submit(client, body):
    return client.post("/api/jobs/", body, format="json")


def flow_body(team="a", **input_extra) -> dict:
    return job_body(team, "flow", input={"messages": [{"role": "user", "content": "go [rounds:3]"}], **input_extra})


@pytest.fixture
def strict_tool(settings):
    settings.TELEMACHUS_TOOLS = ["add=tests.executors.test_tools.add"]


class TestFlow:
    def test_accepted_with_defaults_filled_in(self, api, member_setup):
        response = submit(api(member_setup[0]), flow_body(tools=["echo", "clock"]))
        assert response.status_code == 201, response.json()
        body = response.json()
        assert body["type"] == "flow" and body["rounds"] == 0
        assert body["input"]["tools"] == ["echo", "clock"]
        assert body["input"]["max_rounds"] == 20 and body["input"]["return_tool_errors"] is False

    def test_unknown_tool_is_400_naming_it(self, api, member_setup):
        response = submit(api(member_setup[0]), flow_body(tools=["echo", "teleport"]))
        assert response.status_code == 400
        (message,) = response.json()["fields"]["input"]["tools"]
        assert "unknown tool 'teleport'" in message
        assert not Job.objects.exists()

    def test_tools_need_tools_invoke_400_naming_it(self, api, make_user, make_team, make_executor):
        carol = make_user("carol")
        make_team("lab", {carol: "member"}, grants=("flows:run",))
        make_executor("e", models=["m"])
        assert submit(api(carol), flow_body("lab")).status_code == 201  # no tools: flows:run is enough
        response = submit(api(carol), flow_body("lab", tools=["echo"]))
        assert response.status_code == 400
        (message,) = response.json()["fields"]["input"]["tools"]
        assert "tools:invoke" in message and "'lab'" in message
        assert Job.objects.count() == 1

    @pytest.mark.parametrize(("max_rounds", "status"), [(200, 201), (201, 400), (0, 400), ("many", 400)])
    def test_max_rounds_is_at_most_200(self, api, member_setup, max_rounds, status):
        response = submit(api(member_setup[0]), flow_body(max_rounds=max_rounds))
        assert response.status_code == status
        if status == 400:
            assert "max_rounds" in response.json()["fields"]["input"]

    def test_needs_messages(self, api, member_setup):
        response = submit(api(member_setup[0]), job_body("a", "flow", input={"tools": ["echo"]}))
        assert response.status_code == 400 and "messages" in response.json()["fields"]["input"]

    def test_round_events_are_listed(self, api, member_setup):
        alice = member_setup[0]
        flow = submit(api(alice), flow_body(tools=["echo"])).json()
        (claim,) = job_claim(worker="w", limit=1).claims
        # A flow's claim starts its round (round_started); the worker goes straight to the model.
        round_finish(
            job_id=flow["id"],
            lease=claim.lease,
            round=1,
            prompt_tokens=5,
            completion_tokens=2,
            message={
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "echo", "arguments": "{}"}}],
            },
        )
        events = api(alice).get(f"/api/jobs/{flow['id']}/events/").json()["results"]
        rounds = [e for e in events if e["event"].startswith("round_")]
        assert [e["event"] for e in rounds] == ["round_started", "round_finished"]
        assert rounds[0]["meta"]["round"] == 1 and rounds[0]["executor"] == "shared"
        assert rounds[1]["meta"]["tokens"] == 7 and rounds[1]["meta"]["tools"] == ["echo"]
        assert api(alice).get(f"/api/jobs/{flow['id']}/").json()["rounds"] == 1


class TestTool:
    def test_needs_no_model(self, api, member_setup):
        response = submit(api(member_setup[0]), job_body("a", "tool"))
        assert response.status_code == 201, response.json()
        assert Job.objects.get().model == ""

    def test_unknown_tool_is_400_naming_it(self, api, member_setup):
        response = submit(api(member_setup[0]), job_body("a", "tool", input={"tool": "teleport"}))
        assert response.status_code == 400
        assert "unknown tool 'teleport'" in response.json()["fields"]["input"]["tool"][0]

    def test_arguments_must_fit_the_schema(self, api, member_setup, strict_tool):
        bad = job_body("a", "tool", input={"tool": "add", "arguments": {"a": 1, "b": "two"}})
        response = submit(api(member_setup[0]), bad)
        assert response.status_code == 400
        assert "'two' is not of type 'integer'" in response.json()["fields"]["input"]["arguments"][0]
        good = job_body("a", "tool", input={"tool": "add", "arguments": {"a": 1, "b": 2}})
        assert submit(api(member_setup[0]), good).status_code == 201

    def test_unknown_input_keys_are_refused(self, api, member_setup):
        response = submit(api(member_setup[0]), job_body("a", "tool", input={"tool": "echo", "args": {}}))
        assert response.status_code == 400 and "args" in response.json()["fields"]["input"]

    def test_tool_jobs_are_claimed_without_a_slot(self, api, member_setup, cap):
        alice = member_setup[0]
        cap("global", None, 1)
        submit(api(alice), job_body("a"))  # a chat takes the one slot
        tool_job = submit(api(alice), job_body("a", "tool")).json()
        claims = job_claim(worker="w", limit=4).claims
        assert len(claims) == 2
        (by_tool,) = [c for c in claims if c.executor is None]
        assert by_tool.job.pk == tool_job["id"] and by_tool.slot_id is None
        assert by_tool.job.input == {"tool": "echo", "arguments": {"say": "hi"}}
        assert Job.objects.get(pk=tool_job["id"]).status == "running"
        assert list(JobEvent.objects.filter(job_id=tool_job["id"]).values_list("event", flat=True)) == [
            "queued",
            "started",
        ]


class TestTranslate:
    def test_needs_text_and_target_language(self, api, member_setup):
        response = submit(api(member_setup[0]), job_body("a", "translate", input={"text": "hi"}))
        assert response.status_code == 400 and "target_lang" in response.json()["fields"]["input"]
        assert submit(api(member_setup[0]), job_body("a", "translate")).status_code == 201


def test_a_governed_slot_is_not_submitted_through_the_api(api, member_setup):
    response = submit(api(member_setup[0]), job_body("a", "governed"))
    assert response.status_code == 400 and "type" in response.json()["fields"]
