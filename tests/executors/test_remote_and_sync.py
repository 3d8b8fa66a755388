"""remote-model API keys stay secret end to end; capability sync reads /v1/models."""

import pytest
from django.core.management import call_command
from django.db import connection

from executors.models import Executor
from scheduler.models import Job, JobEvent
from scheduler.services.submit import job_submit
from tests.processes import free_port, wait_until

KEY = "sk-live-telemachus-5ecret-key-0042"
REMOTE = {
    "name": "hosted",
    "kind": "remote-model",
    "capabilities": {"models": ["m"]},
    "transport": {"api_key_env": "HOSTED_API_KEY"},
}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_api_key_never_leaves_the_environment(processes, api, operator, member_setup, client, tmp_path):
    alice = member_setup[0]
    member_setup[4].delete()
    # One executor the server accepts the key for, one where the server echoes the key back in its error.
    right = processes.faultserver(FAULT_EXPECTED_KEY=KEY)
    wrong = processes.faultserver(FAULT_EXPECTED_KEY="something-else")
    admin_api = api(operator)
    for name, base in (("hosted", right), ("echoing", wrong)):
        response = admin_api.post(
            "/api/executors/", {**REMOTE, "name": name, "endpoint": f"{base}/auth/v1"}, format="json"
        )
        assert response.status_code == 201, response.json()
    Executor.objects.filter(name="echoing").update(weight=5)
    jobs = [
        job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )
        for _ in range(2)
    ]
    worker = processes.worker("w", HOSTED_API_KEY=KEY, TELEMACHUS_PROBE_INTERVAL_SECONDS="0.5")
    wait_until(lambda: not Job.objects.exclude(status__in=Job.TERMINAL).exists(), timeout=30, what="jobs to end")
    wait_until(lambda: Executor.objects.filter(last_probed_at__isnull=False).count() == 2, timeout=10, what="probes")

    statuses = {job.executor.name: job.status for job in Job.objects.select_related("executor")}
    assert statuses == {"hosted": "done", "echoing": "failed"}, "the key was sent, and only where it belongs"
    failed = Job.objects.get(status="failed")
    assert "invalid credentials: Bearer ***" in failed.error

    client.force_login(operator)
    pages = [
        admin_api.get(path).content
        for path in (
            "/api/executors/",
            *(f"/api/executors/{e.pk}/" for e in Executor.objects.all()),
            *(f"/api/executors/{e.pk}/events/" for e in Executor.objects.all()),
            "/api/queue/",
            "/api/jobs/",
            *(f"/api/jobs/{j.pk}/events/" for j in jobs),
        )
    ]
    pages += [
        client.get(path).content
        for path in (
            "/admin/executors/executor/",
            *(f"/admin/executors/executor/{e.pk}/change/" for e in Executor.objects.all()),
            "/admin/scheduler/job/",
            *(f"/admin/scheduler/job/{j.pk}/change/" for j in jobs),
            "/admin/scheduler/jobevent/",
        )
    ]
    for page in pages:
        assert KEY.encode() not in page
    stored = [str(row) for row in JobEvent.objects.values_list("meta", flat=True)]
    stored += [str(row) for row in Job.objects.values_list("error", "result", "input", "meta")]
    stored += [str(row) for row in Executor.objects.values_list("transport", "meta", "capabilities", "endpoint")]
    assert not any(KEY in text for text in stored)
    worker.terminate()
    worker.wait(timeout=20)
    assert KEY not in worker.log_path.read_text()
    connection.close()


@pytest.mark.django_db
class TestExecutorValidation:
    @pytest.mark.parametrize("transport", [{"token": "x"}, {"Authorization": "Bearer x"}, {"auth": {"password": "x"}}])
    def test_secrets_outside_their_places_are_refused(self, api, operator, transport):
        body = {**REMOTE, "endpoint": "http://127.0.0.1:9/v1", "transport": transport}
        response = api(operator).post("/api/executors/", body, format="json")
        assert response.status_code == 400
        assert "transport.api_key" in str(response.json()["fields"]["transport"])
        assert not Executor.objects.exists()

    def test_remote_model_needs_a_key(self, api, operator):
        body = {**REMOTE, "endpoint": "http://127.0.0.1:9/v1", "transport": {}}
        response = api(operator).post("/api/executors/", body, format="json")
        assert response.status_code == 400 and "transport.api_key" in str(response.json()["fields"]["transport"])

    def test_key_variable_must_be_a_name(self, api, operator):
        body = {**REMOTE, "endpoint": "http://127.0.0.1:9/v1", "transport": {"api_key_env": "sk-123 456"}}
        assert api(operator).post("/api/executors/", body, format="json").status_code == 400


@pytest.mark.slow
@pytest.mark.django_db
class TestSync:
    def test_api_sync_reads_the_servers_models(self, processes, api, operator):
        base = processes.simllm(models="llama3,qwen2")
        executor = Executor.objects.create(
            name="box", kind="local-model", endpoint=f"{base}/v1", capabilities={"models": ["old"], "class": "gpu"}
        )
        response = api(operator).post(f"/api/executors/{executor.pk}/sync/")
        assert response.status_code == 200
        assert response.json()["capabilities"] == {"models": ["llama3", "qwen2"], "class": "gpu"}

    def test_command_sync(self, processes, capsys):
        base = processes.simllm(models="phi3")
        Executor.objects.create(name="box", kind="local-model", endpoint=f"{base}/v1", capabilities={"models": []})
        call_command("executor_sync", "box")
        assert "box: phi3" in capsys.readouterr().out
        assert Executor.objects.get(name="box").offered_models == ["phi3"]

    def test_unreachable_is_502_and_changes_nothing(self, api, operator):
        executor = Executor.objects.create(
            name="gone",
            kind="local-model",
            endpoint=f"http://127.0.0.1:{free_port()}/v1",
            capabilities={"models": ["keep"]},
        )
        response = api(operator).post(f"/api/executors/{executor.pk}/sync/")
        assert response.status_code == 502 and response.json()["error"] == "executor_unreachable"
        assert Executor.objects.get(pk=executor.pk).offered_models == ["keep"]

    def test_sim_does_not_report_models(self, api, operator, make_executor):
        executor = make_executor("s")
        response = api(operator).post(f"/api/executors/{executor.pk}/sync/")
        assert response.status_code == 409 and response.json()["error"] == "conflict"

    def test_members_cannot_sync(self, api, member_setup):
        assert api(member_setup[0]).post(f"/api/executors/{member_setup[4].pk}/sync/").status_code == 403
