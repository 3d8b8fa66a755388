import json
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from executors.models import Executor
from scheduler.models import Job, JobEvent, TeamShare
from scheduler.services.claim import job_claim
from scheduler.services.finish import job_finish
from scheduler.services.retention import job_missing
from scheduler.services.submit import job_submit
from telemachus.control.features import feature_set
from tests.conftest import chat_body, job_body

pytestmark = pytest.mark.django_db


def submit(client, body):
    return client.post("/api/jobs/", body, format="json")


class TestSubmit:
    def test_member_submits_into_own_team(self, api, member_setup):
        alice, _, team_a, _, _ = member_setup
        response = submit(api(alice), chat_body("a"))
        assert response.status_code == 201, response.json()
        job = response.json()
        assert job["status"] == "queued"
        assert job["team"] == "a" and job["user"] == "alice"
        assert job["requirements"] == {"model": "m", "est_tokens": 100}
        stored = Job.objects.get(pk=job["id"])
        assert stored.model == "m" and stored.cost_estimate == 100
        assert list(stored.events.values_list("event", flat=True)) == ["queued"]

    def test_operator_submits_into_any_team(self, api, operator, member_setup):
        response = submit(api(operator), chat_body("b"))
        assert response.status_code == 201
        assert response.json()["user"] == "operator"

    def test_unauthenticated_is_rejected(self, api, member_setup):
        response = submit(api(), chat_body("a"))
        assert response.status_code == 401
        assert response.json()["error"] == "not_authenticated"
        assert not Job.objects.exists()

    def test_session_authentication_with_csrf(self, member_setup):
        # A browser session (the admin's login) works too; unsafe methods then need the CSRF token.
        alice = member_setup[0]
        browser = Client(enforce_csrf_checks=True)
        browser.force_login(alice)
        assert browser.get("/api/jobs/").status_code == 200
        refused = browser.post("/api/jobs/", chat_body("a"), content_type="application/json")
        assert refused.status_code == 403 and "CSRF" in refused.json()["detail"]
        browser.get("/admin/login/")  # sets the csrftoken cookie
        accepted = browser.post(
            "/api/jobs/",
            chat_body("a"),
            content_type="application/json",
            HTTP_X_CSRFTOKEN=browser.cookies["csrftoken"].value,
        )
        assert accepted.status_code == 201 and accepted.json()["user"] == "alice"

    @pytest.mark.parametrize("team", ["b", "nope"])
    def test_team_not_joined_or_missing_reads_the_same(self, api, member_setup, team):
        alice = member_setup[0]
        response = submit(api(alice), chat_body(team))
        assert response.status_code == 400
        body = response.json()
        assert body["error"] == "validation_error"
        assert body["fields"]["team"] == [f"No team {team!r} that you belong to."]
        assert not Job.objects.exists()

    def test_unknown_model(self, api, member_setup):
        response = submit(api(member_setup[0]), chat_body("a", model="gpt-nope"))
        assert response.status_code == 400
        assert response.json()["error"] == "unknown_model"
        assert response.json()["model"] == "gpt-nope"
        assert not Job.objects.exists() and not JobEvent.objects.exists()

    def test_model_only_on_a_disabled_executor_is_unknown(self, api, member_setup):
        member_setup[4].enabled = False
        member_setup[4].save()
        response = submit(api(member_setup[0]), chat_body("a"))
        assert response.status_code == 400 and response.json()["error"] == "unknown_model"

    def test_model_on_another_teams_executor_is_unknown(self, api, member_setup, make_executor):
        _, _, _, team_b, _ = member_setup
        make_executor("b-only", models=["private"], team=team_b)
        response = submit(api(member_setup[0]), chat_body("a", model="private"))
        assert response.status_code == 400 and response.json()["error"] == "unknown_model"

    @pytest.mark.parametrize(
        "body",
        [
            chat_body("a", model="cpu"),
            {
                "type": "translate",
                "team": "a",
                "requirements": {"model": "cpu"},
                "input": {"text": "hi", "target_lang": "fr"},
            },
        ],
        ids=["chat", "translate"],
    )
    def test_a_cpu_node_pseudo_model_takes_no_model_call(self, api, member_setup, make_executor, body):
        make_executor("cpu", models=["cpu"], kind="cpu-node")
        response = submit(api(member_setup[0]), body)
        assert response.status_code == 400 and response.json()["error"] == "unknown_model"
        assert response.json()["model"] == "cpu" and "'cpu'" in response.json()["detail"]
        task = {
            "type": "task",
            "team": "a",
            "requirements": {"model": "cpu"},
            "input": {"callable": "telemachus.add", "args": [1, 2]},
        }
        assert submit(api(member_setup[0]), task).status_code == 201, "its task jobs are still welcome"

    def test_a_chat_job_is_never_placed_on_a_cpu_node(self, api, member_setup, make_executor):
        cpu = make_executor("cpu", models=["m"], kind="cpu-node", max_concurrency=8)
        assert submit(api(member_setup[0]), chat_body("a")).status_code == 201
        (claim,) = job_claim(worker="w", limit=1).claims
        assert claim.executor.pk == member_setup[4].pk != cpu.pk

    def test_a_task_job_naming_a_chat_model_is_refused_even_with_chat_switched_off(self, api, member_setup, operator):
        # Given chat switched off for team a, whose only executor for model m is a sim (a model server)...
        feature_set(feature="chat", team=member_setup[2], enabled=False, by=operator)
        task = {"type": "task", "team": "a", "requirements": {"model": "m"}, "input": {"callable": "telemachus.add"}}
        # ...a task job naming m would run as a chat completion: it is refused, naming type and model.
        response = submit(api(member_setup[0]), task)
        assert response.status_code == 400, response.content
        assert response.json()["error"] == "validation_error"
        (message,) = response.json()["fields"]["type"]
        assert "'task'" in message and "'m'" in message and "sim" in message
        assert not Job.objects.exists()

    def test_a_task_job_is_never_placed_on_a_model_executor(self, api, member_setup, make_executor):
        # Given model m offered by a cpu-node and by the sim, and a task job admitted for the cpu-node...
        cpu = make_executor("cpu", models=["m"], kind="cpu-node", max_concurrency=1)
        task = {"type": "task", "team": "a", "requirements": {"model": "m"}, "input": {"callable": "telemachus.add"}}
        assert submit(api(member_setup[0]), task).status_code == 201
        assert submit(api(member_setup[0]), task).status_code == 201
        # When the claim places both, the cpu-node's one slot is all they may use.
        claims = job_claim(worker="w", limit=2).claims
        assert [c.executor.pk for c in claims] == [cpu.pk]
        Executor.objects.filter(pk=cpu.pk).update(enabled=False)
        assert job_claim(worker="w", limit=2).claims == []
        assert Job.objects.filter(status="queued").count() == 1

    def test_team_owned_executor_serves_its_team(self, api, member_setup, make_executor):
        _, bob, _, team_b, _ = member_setup
        make_executor("b-only", models=["private"], team=team_b)
        assert submit(api(bob), chat_body("b", model="private")).status_code == 201

    @pytest.mark.parametrize(
        ("change", "field_path"),
        [
            ({"requirements": {"model": "m", "est_tokens": -1}}, ("requirements", "est_tokens")),
            ({"requirements": {"model": "m", "est_tokens": "lots"}}, ("requirements", "est_tokens")),
            ({"requirements": {"model": "m", "est_tokens": 1.5}}, ("requirements", "est_tokens")),
            ({"requirements": {"est_tokens": 5}}, ("requirements", "model")),
            ({"requirements": {"model": "m", "class": "tpu"}}, ("requirements", "class")),
            ({"requirements": {"model": "m", "gpus": 8}}, ("requirements", "gpus")),
            ({"input": {"messages": "hello"}}, ("input", "messages")),
            ({"input": {"messages": []}}, ("input", "messages")),
            ({"input": {"messages": [{"content": "no role"}]}}, ("input", "messages")),
            ({"input": {"messages": [{"role": "wizard", "content": "x"}]}}, ("input", "messages")),
            ({"input": {"messages": [{"role": "user"}]}}, ("input", "messages")),
            ({"input": "hello"}, ("input",)),
            ({"type": "batch"}, ("type",)),
            ({"priority": 101}, ("priority",)),
            ({"priority": "high"}, ("priority",)),
            ({"status": "done"}, ("status",)),
            ({"user": "bob"}, ("user",)),
            ({"tokens_used": 0}, ("tokens_used",)),
            ({"executor": "shared"}, ("executor",)),
            ({"attempts": 5}, ("attempts",)),
        ],
    )
    def test_bad_input_is_a_validation_error_and_persists_nothing(self, api, member_setup, change, field_path):
        response = submit(api(member_setup[0]), chat_body("a", **change))
        assert response.status_code == 400, response.json()
        body = response.json()
        assert body["error"] == "validation_error"
        errors = body["fields"]
        for key in field_path:
            assert key in errors, errors
            errors = errors[key]
        assert not Job.objects.exists() and not JobEvent.objects.exists()

    def test_missing_body_fields(self, api, member_setup):
        response = submit(api(member_setup[0]), {})
        assert response.status_code == 400
        assert set(response.json()["fields"]) == {"type", "team", "requirements", "input"}

    def test_malformed_json(self, api, member_setup):
        response = api(member_setup[0]).post("/api/jobs/", "{not json", content_type="application/json")
        assert response.status_code == 400
        assert response.json()["error"] == "parse_error"

    @override_settings(TELEMACHUS_MAX_BODY_BYTES=2048)
    def test_body_over_the_limit_is_413(self, api, member_setup):
        body = chat_body("a", input={"messages": [{"role": "user", "content": "x" * 4096}]})
        response = api(member_setup[0]).post("/api/jobs/", json.dumps(body), content_type="application/json")
        assert response.status_code == 413
        assert response.json() == {
            "error": "payload_too_large",
            "detail": "Request body exceeds 2048 bytes.",
            "limit": 2048,
        }
        assert not Job.objects.exists()

    def test_extra_input_options_pass_through(self, api, member_setup):
        body = chat_body("a")
        body["input"]["temperature"] = 0.2
        response = submit(api(member_setup[0]), body)
        assert response.status_code == 201
        assert Job.objects.get().input["temperature"] == 0.2

    def test_task_jobs_need_no_messages(self, api, member_setup, make_executor):
        make_executor("cpu", models=["q"], kind="cpu-node")
        body = chat_body("a", model="q", type="task", input={"callable": "demo.add", "args": [1, 2]})
        assert submit(api(member_setup[0]), body).status_code == 201


class TestListAndDetail:
    def test_list_shows_only_own_teams_jobs(self, api, member_setup):
        alice, bob, *_ = member_setup
        mine = submit(api(alice), chat_body("a")).json()
        theirs = submit(api(bob), chat_body("b")).json()
        listed = api(alice).get("/api/jobs/").json()
        assert [j["id"] for j in listed["results"]] == [mine["id"]]
        assert theirs["id"] not in [j["id"] for j in api(alice).get("/api/jobs/?team=b").json()["results"]]

    def test_operator_lists_everything(self, api, operator, member_setup):
        alice, bob, *_ = member_setup
        submit(api(alice), chat_body("a"))
        submit(api(bob), chat_body("b"))
        assert len(api(operator).get("/api/jobs/").json()["results"]) == 2

    def test_filters(self, api, operator, member_setup):
        alice = member_setup[0]
        first = submit(api(alice), chat_body("a")).json()
        second = submit(api(alice), job_body("a", "translate")).json()
        api(alice).post(f"/api/jobs/{first['id']}/cancel/")
        client = api(operator)
        assert [j["id"] for j in client.get("/api/jobs/?status=canceled").json()["results"]] == [first["id"]]
        assert [j["id"] for j in client.get("/api/jobs/?type=translate").json()["results"]] == [second["id"]]
        both = client.get("/api/jobs/?status=canceled&status=queued").json()["results"]
        assert {j["id"] for j in both} == {first["id"], second["id"]}
        assert client.get("/api/jobs/?team=b").json()["results"] == []

    def test_bad_filter_is_a_validation_error(self, api, operator):
        response = api(operator).get("/api/jobs/?status=sleeping")
        assert response.status_code == 400
        assert "status" in response.json()["fields"]

    def test_pagination_is_newest_first_with_cursors(self, api, member_setup):
        alice = member_setup[0]
        ids = [submit(api(alice), chat_body("a")).json()["id"] for _ in range(5)]
        page = api(alice).get("/api/jobs/?page_size=2").json()
        assert [j["id"] for j in page["results"]] == ids[::-1][:2]
        following = api(alice).get(page["next"]).json()
        assert [j["id"] for j in following["results"]] == ids[::-1][2:4]

    def test_detail(self, api, member_setup):
        alice = member_setup[0]
        job = submit(api(alice), chat_body("a")).json()
        detail = api(alice).get(f"/api/jobs/{job['id']}/").json()
        assert detail == job
        assert set(detail) >= {
            "id",
            "type",
            "team",
            "user",
            "priority",
            "status",
            "requirements",
            "executor",
            "submitted_at",
            "started_at",
            "finished_at",
            "tokens_used",
            "attempts",
            "result",
            "error",
        }

    def test_list_query_count_does_not_grow_with_jobs(self, api, member_setup):
        alice = member_setup[0]
        client = api(alice)

        def queries_to_list(expected: int) -> int:
            with CaptureQueriesContext(connection) as queries:
                assert len(client.get("/api/jobs/").json()["results"]) == expected
            return len(queries)

        submit(client, chat_body("a"))
        one = queries_to_list(1)
        for _ in range(19):
            submit(client, chat_body("a"))
        assert queries_to_list(20) == one


class TestCrossTeamIsolation:
    """A job of another team does not exist, as far as the caller can tell."""

    @pytest.fixture
    def bobs_job(self, member_setup):
        _, bob, *_ = member_setup
        return job_submit(user=bob, team="b", type="chat", requirements={"model": "m"}, input={"messages": []})

    @pytest.mark.parametrize("path", ["/api/jobs/{id}/", "/api/jobs/{id}/events/"])
    def test_get_is_404(self, api, member_setup, bobs_job, path):
        response = api(member_setup[0]).get(path.format(id=bobs_job.pk))
        assert response.status_code == 404
        assert response.json()["error"] == "not_found"
        assert response.json() == api(member_setup[0]).get(path.format(id=999_999)).json() | {
            "detail": job_missing(bobs_job.pk)
        }

    def test_cancel_is_404_and_changes_nothing(self, api, member_setup, bobs_job):
        response = api(member_setup[0]).post(f"/api/jobs/{bobs_job.pk}/cancel/")
        assert response.status_code == 404
        bobs_job.refresh_from_db()
        assert bobs_job.status == "queued"

    def test_lists_never_include_it(self, api, member_setup, bobs_job):
        client = api(member_setup[0])
        for query in ("", "?team=b", "?status=queued"):
            assert client.get(f"/api/jobs/{query}").json()["results"] == []


class TestCancel:
    def test_cancel_queued_job(self, api, member_setup):
        alice = member_setup[0]
        job = submit(api(alice), chat_body("a")).json()
        response = api(alice).post(f"/api/jobs/{job['id']}/cancel/")
        assert response.status_code == 200
        assert response.json()["status"] == "canceled"
        assert response.json()["finished_at"] is not None
        events = api(alice).get(f"/api/jobs/{job['id']}/events/").json()["results"]
        assert [e["event"] for e in events] == ["queued", "canceled"]
        assert events[1]["meta"] == {"was": "queued", "by": "alice", "reason": "canceled by alice"}
        assert response.json()["error"] == "canceled by alice" and response.json()["tokens_used"] == 0

    def test_cancel_running_job_bills_its_attempt(self, api, member_setup):
        alice = member_setup[0]
        job = submit(api(alice), chat_body("a", requirements={"model": "m", "est_tokens": 70})).json()
        job_claim(worker="w", limit=1)
        response = api(alice).post(f"/api/jobs/{job['id']}/cancel/")
        assert (response.json()["status"], response.json()["tokens_used"]) == ("canceled", 70)
        events = api(alice).get(f"/api/jobs/{job['id']}/events/").json()["results"]
        assert events[-1]["meta"] == {
            "was": "running",
            "by": "alice",
            "reason": "canceled by alice",
            "tokens": 70,
            "billed": "estimate",
        }

    def test_cancel_charges_fair_share_for_the_attempt_not_since_the_first_start(self, api, member_setup):
        # Given a job whose first attempt started an hour ago, running again now (a retry)...
        alice = member_setup[0]
        job = submit(api(alice), chat_body("a")).json()
        Job.objects.filter(pk=job["id"]).update(started_at=timezone.now() - timedelta(hours=1))
        job_claim(worker="w", limit=1)
        # When it is canceled, fair share is charged the seconds this attempt held its slot.
        api(alice).post(f"/api/jobs/{job['id']}/cancel/")
        assert TeamShare.objects.get(team__slug="a").usage < 60

    def test_cancel_finished_job_is_409(self, api, member_setup):
        alice = member_setup[0]
        job = submit(api(alice), chat_body("a")).json()
        api(alice).post(f"/api/jobs/{job['id']}/cancel/")
        response = api(alice).post(f"/api/jobs/{job['id']}/cancel/")
        assert response.status_code == 409
        assert response.json()["error"] == "conflict"
        assert response.json()["status"] == "canceled"
        assert Job.objects.get(pk=job["id"]).events.count() == 2

    def test_cancel_missing_job_is_404(self, api, member_setup):
        assert api(member_setup[0]).post("/api/jobs/424242/cancel/").status_code == 404


class TestRequeue:
    def failed_job(self, member_setup) -> Job:
        alice = member_setup[0]
        job = job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )
        (claim,) = job_claim(worker="w", limit=1).claims
        job_finish(job_id=job.pk, lease=claim.lease, error="upstream said no", tokens_used=5)
        return Job.objects.get(pk=job.pk)

    def test_operator_requeues_a_failed_job_which_then_runs_again(self, api, operator, member_setup):
        job = self.failed_job(member_setup)
        assert (job.status, job.attempts) == ("failed", 1)
        response = api(operator).post(f"/api/jobs/{job.pk}/requeue/")
        assert response.status_code == 200, response.json()
        body = response.json()
        assert (body["status"], body["attempts"], body["error"], body["finished_at"]) == ("queued", 0, "", None)
        requeued = JobEvent.objects.filter(job=job).last()
        assert (requeued.event, requeued.meta) == (
            "requeued",
            {"reason": "operator", "was": "failed", "by": "operator"},
        )
        assert [c.job.pk for c in job_claim(worker="w", limit=1).claims] == [job.pk]

    def test_a_member_may_not(self, api, member_setup):
        job = self.failed_job(member_setup)
        response = api(member_setup[0]).post(f"/api/jobs/{job.pk}/requeue/")
        assert response.status_code == 403
        assert response.json()["error"] == "forbidden" and response.json()["permission"] == "scheduler.manage"
        assert Job.objects.get(pk=job.pk).status == "failed"

    def test_another_teams_member_gets_404(self, api, member_setup):
        job = self.failed_job(member_setup)
        assert api(member_setup[1]).post(f"/api/jobs/{job.pk}/requeue/").status_code == 404

    def test_only_failed_or_canceled_jobs(self, api, operator, member_setup):
        queued = job_submit(
            user=member_setup[0], team="a", type="chat", requirements={"model": "m"}, input={"messages": []}
        )
        response = api(operator).post(f"/api/jobs/{queued.pk}/requeue/")
        assert response.status_code == 409 and response.json()["status"] == "queued"
        job_claim(worker="w", limit=1)
        assert api(operator).post(f"/api/jobs/{queued.pk}/requeue/").json()["status"] == "running"
        assert api(operator).post("/api/jobs/424242/requeue/").status_code == 404
