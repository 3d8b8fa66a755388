"""Executors' credentials are write-only: given through the API or the admin, stored sealed or as
a reference to the environment, never shown back (masked, by the API, the admin and the audit
log), refused where they would be stored in clear (the endpoint URL, meta, any other transport
field), sent by the drivers to a real model server that checks them, moved out of clear text by
the data migration, and resealed under a new key by the rotation."""

import asyncio
import importlib
import io
import json
from base64 import b64encode

import aiohttp
import pytest
from cryptography.fernet import Fernet
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from executors.contract import DispatchError, DispatchRequest
from executors.credentials import plain_secrets_moved, transport_headers, transport_shown
from executors.drivers.openai import LocalModelDriver, RemoteModelDriver
from executors.models import Executor
from executors.sealing import SecretUnreadable, secret_unseal
from scheduler.models import Job
from scheduler.services.submit import job_submit
from telemachus.models import AuditEvent
from tests.processes import free_port, responds, wait_until

KEY = "sk-live-0123456789-abcdef-secret"
OTHER = "sk-live-9876543210-fedcba-secret"
HEADER_KEY = "azure-5ecret-header-value-42"
BODY = {
    "name": "hosted",
    "kind": "remote-model",
    "endpoint": "http://127.0.0.1:9/v1",
    "capabilities": {"models": ["m"]},
}


def stored(name: str = "hosted") -> dict:
    return Executor.objects.get(name=name).transport


def raw_row(name: str = "hosted") -> str:
    """The row as the database holds it, every column."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {Executor._meta.db_table} WHERE name = %s", [name])
        return repr(cursor.fetchone())


def keyed_simllm(processes, key: str, header: str = "Authorization") -> str:
    """simllm requiring a key; ready once it answers at all (its /v1/models wants the key too)."""
    port = free_port()
    processes.start(
        f"simllm-{port}", "simllm", "--port", str(port), "--models", "m", "--api-key-header", header, SIMLLM_API_KEY=key
    )
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: responds(f"{base}/v1/models"), timeout=20, what="simllm to listen")
    return base


def request(stream: bool = False) -> DispatchRequest:
    return DispatchRequest(
        job_id=1, type="chat", model="m", input={"messages": [{"role": "user", "content": "hi"}], "stream": stream}
    )


def dispatch(executor: Executor):
    driver = (RemoteModelDriver if executor.kind == "remote-model" else LocalModelDriver)(executor)

    async def go():
        try:
            return await driver.dispatch(request())
        finally:
            await driver.aclose()

    return asyncio.run(go())


@pytest.mark.django_db
class TestTheApi:
    def test_secrets_are_sealed_masked_and_never_shown(self, api, operator, monkeypatch):
        monkeypatch.setenv("ORG_HEADER", "org-1")
        client = api(operator)
        body = {
            **BODY,
            "transport": {
                "api_key": KEY,
                "timeout_s": 30,
                "headers": {"api-key": HEADER_KEY, "OpenAI-Organization": {"env": "ORG_HEADER"}},
            },
        }
        created = client.post("/api/executors/", body, format="json")
        assert created.status_code == 201, created.json()
        shown = created.json()["transport"]
        assert shown["api_key"].startswith("******** (") and shown["timeout_s"] == 30
        assert shown["headers"]["api-key"].startswith("******** (")
        assert shown["headers"]["OpenAI-Organization"] == {"env": "ORG_HEADER"}
        pages = [created.content, client.get("/api/executors/").content]
        pages.append(client.get(f"/api/executors/{created.json()['id']}/").content)
        for secret in (KEY, HEADER_KEY):
            assert not any(secret.encode() in page for page in pages)
            assert secret not in raw_row()
        row = stored()
        assert secret_unseal(row["api_key"]["sealed"]) == KEY
        assert secret_unseal(row["headers"]["api-key"]["sealed"]) == HEADER_KEY
        assert transport_headers(row, executor="hosted") == {
            "Authorization": f"Bearer {KEY}",
            "api-key": HEADER_KEY,
            "OpenAI-Organization": "org-1",
        }

    def test_a_transport_read_and_sent_back_keeps_its_secrets(self, api, operator):
        client = api(operator)
        executor_id = client.post("/api/executors/", {**BODY, "transport": {"api_key": KEY}}, format="json").json()[
            "id"
        ]
        shown = client.get(f"/api/executors/{executor_id}/").json()["transport"]
        edited = client.patch(f"/api/executors/{executor_id}/", {"transport": {**shown, "timeout_s": 9}}, format="json")
        assert edited.status_code == 200 and edited.json()["transport"] == {**shown, "timeout_s": 9}
        assert secret_unseal(stored()["api_key"]["sealed"]) == KEY
        # A new key shows a new fingerprint; a mask with nothing stored at its place is refused.
        replaced = client.patch(f"/api/executors/{executor_id}/", {"transport": {"api_key": OTHER}}, format="json")
        assert replaced.json()["transport"]["api_key"] != shown["api_key"]
        nothing = client.patch(
            f"/api/executors/{executor_id}/",
            {"transport": {"api_key_env": "X", "headers": {"x-key": shown["api_key"]}}},
            format="json",
        )
        assert nothing.status_code == 400 and "nothing is stored here" in str(nothing.json()["fields"])

    def test_the_audit_log_records_changes_masked(self, api, operator):
        client = api(operator)
        executor_id = client.post("/api/executors/", {**BODY, "transport": {"api_key": KEY}}, format="json").json()[
            "id"
        ]
        client.patch(f"/api/executors/{executor_id}/", {"transport": {"api_key": OTHER}}, format="json")
        client.delete(f"/api/executors/{executor_id}/")
        events = list(AuditEvent.objects.filter(object_type="executor").order_by("pk"))
        assert [e.action for e in events] == ["executor.create", "executor.update", "executor.delete"]
        text = json.dumps([[e.before, e.after] for e in events])
        assert KEY not in text and OTHER not in text and "sealed" not in text
        update = events[1]
        assert update.before["transport"]["api_key"] != update.after["transport"]["api_key"]  # the change shows
        assert update.after["transport"]["api_key"].startswith("******** (")

    @pytest.mark.parametrize(
        ("field", "body", "where"),
        [
            ("endpoint", {"endpoint": f"https://user:{KEY}@llm.example/v1"}, "transport.api_key"),
            ("endpoint", {"endpoint": f"https://llm.example/v1?api_key={KEY}"}, "transport.headers"),
            ("meta", {"meta": {"api_key": KEY}}, "transport.api_key"),
            ("meta", {"meta": {"provider": {"password": KEY}}}, "transport.api_key"),
            ("transport", {"transport": {"api_key": KEY, "token": KEY}}, "transport.api_key"),
            ("transport", {"transport": {"api_key": KEY, "api_key_env": "K"}}, "not both"),
            ("transport", {"transport": {"api_key": KEY, "headers": {"Authorization": KEY}}}, "one or the other"),
            ("transport", {"transport": {"headers": {"Host": "x"}}}, "not a header name"),
            ("transport", {"transport": {"api_key": {"env": "not a name"}}}, "environment variable"),
        ],
    )
    def test_secrets_where_they_would_be_stored_in_clear_are_refused(self, api, operator, field, body, where):
        response = api(operator).post("/api/executors/", {**BODY, "transport": {"api_key": KEY}, **body}, format="json")
        assert response.status_code == 400
        assert where in json.dumps(response.json()["fields"][field])
        assert not Executor.objects.exists()


@pytest.mark.django_db
class TestTheAdmin:
    def test_a_view_only_user_sees_that_a_secret_is_set_and_nothing_of_it(self, client, api, operator, make_user):
        api(operator).post("/api/executors/", {**BODY, "transport": {"api_key": KEY}}, format="json")
        executor = Executor.objects.get()
        viewer = make_user("viewer", is_staff=True)
        viewer.user_permissions.add(Permission.objects.get(codename="view_executor"))
        client.force_login(viewer)
        page = client.get(f"/admin/executors/executor/{executor.pk}/change/").content.decode()
        assert transport_shown(executor.transport)["api_key"] in page
        assert KEY not in page and executor.transport["api_key"]["sealed"] not in page
        assert KEY not in client.get("/admin/executors/executor/").content.decode()

    def form(self, executor: Executor, **changes) -> dict:
        data = {
            "name": executor.name,
            "kind": executor.kind,
            "endpoint": executor.endpoint,
            "capabilities": json.dumps(executor.capabilities),
            "max_concurrency": executor.max_concurrency,
            "weight": executor.weight,
            "enabled": "on",
            "transport": json.dumps(transport_shown(executor.transport)),
            "meta": "{}",
            "prices": "{}",
        }
        return {**data, **changes}

    def test_an_operator_edits_around_the_secret_or_replaces_it(self, client, api, operator):
        api(operator).post("/api/executors/", {**BODY, "transport": {"api_key": KEY}}, format="json")
        executor = Executor.objects.get()
        client.force_login(operator)
        url = f"/admin/executors/executor/{executor.pk}/change/"
        page = client.get(url).content.decode()
        assert KEY not in page and executor.transport["api_key"]["sealed"] not in page
        assert client.post(url, self.form(executor, max_concurrency=7)).status_code == 302
        assert Executor.objects.get().max_concurrency == 7
        assert secret_unseal(stored()["api_key"]["sealed"]) == KEY
        assert client.post(url, self.form(executor, transport=json.dumps({"api_key": OTHER}))).status_code == 302
        assert secret_unseal(stored()["api_key"]["sealed"]) == OTHER
        assert OTHER not in json.dumps(list(AuditEvent.objects.values_list("before", "after")))

    @pytest.mark.parametrize(
        "changes",
        [
            {"endpoint": f"https://user:{KEY}@llm.example/v1"},
            {"meta": json.dumps({"api_key": KEY})},
            {"transport": json.dumps({"api_key": KEY, "password": KEY})},
        ],
    )
    def test_the_admin_refuses_secrets_in_clear(self, client, api, operator, changes):
        api(operator).post("/api/executors/", {**BODY, "transport": {"api_key": OTHER}}, format="json")
        executor = Executor.objects.get()
        client.force_login(operator)
        response = client.post(f"/admin/executors/executor/{executor.pk}/change/", self.form(executor, **changes))
        assert response.status_code == 200 and "transport.api_key" in response.content.decode()
        assert KEY not in raw_row()


@pytest.mark.slow
@pytest.mark.django_db
class TestTheDriversSendTheRealSecret:
    """Against simllm with a required key (as vLLM's --api-key), in a process of its own."""

    def test_a_sealed_key_and_an_environment_header_reach_the_server(self, processes, api, operator, monkeypatch):
        bearer = keyed_simllm(processes, KEY)
        azure = keyed_simllm(processes, HEADER_KEY, "api-key")
        client = api(operator)
        client.post(
            "/api/executors/", {**BODY, "endpoint": f"{bearer}/v1", "transport": {"api_key": KEY}}, format="json"
        )
        monkeypatch.setenv("AZURE_KEY", HEADER_KEY)
        other = {
            **BODY,
            "name": "azure",
            "endpoint": f"{azure}/v1",
            "transport": {"headers": {"api-key": {"env": "AZURE_KEY"}}},
        }
        assert client.post("/api/executors/", other, format="json").status_code == 201
        for name in ("hosted", "azure"):
            assert dispatch(Executor.objects.get(name=name)).output["message"]["content"]

        # A wrong key: the server refuses it, and the error does not repeat it.
        client.patch(
            f"/api/executors/{Executor.objects.get(name='hosted').pk}/",
            {"transport": {"api_key": OTHER}},
            format="json",
        )
        with pytest.raises(DispatchError) as refused:
            dispatch(Executor.objects.get(name="hosted"))
        assert refused.value.status == 401 and OTHER not in str(refused.value)
        monkeypatch.delenv("AZURE_KEY")
        with pytest.raises(DispatchError) as unset:
            dispatch(Executor.objects.get(name="azure"))
        assert "AZURE_KEY" in str(unset.value) and not unset.value.retryable

    def test_a_key_no_configured_key_unseals_fails_the_dispatch_saying_so(self, processes, api, operator):
        bearer = keyed_simllm(processes, KEY)
        api(operator).post(
            "/api/executors/", {**BODY, "endpoint": f"{bearer}/v1", "transport": {"api_key": KEY}}, format="json"
        )
        with (
            override_settings(SECRET_KEY="another-secret-key-entirely-0123456789"),
            pytest.raises(DispatchError) as caught,
        ):
            dispatch(Executor.objects.get())
        assert "cannot be unsealed" in str(caught.value) and not caught.value.retryable

    @pytest.mark.django_db(transaction=True)
    def test_a_worker_process_runs_jobs_with_a_sealed_key(self, processes, api, operator, member_setup):
        alice, *_rest, shared = member_setup
        shared.delete()
        server = keyed_simllm(processes, KEY)
        created = api(operator).post(
            "/api/executors/", {**BODY, "endpoint": f"{server}/v1", "transport": {"api_key": KEY}}, format="json"
        )
        assert created.status_code == 201
        job = job_submit(user=alice, team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
        worker = processes.worker("w", TELEMACHUS_PROBE_INTERVAL_SECONDS="3600")
        wait_until(lambda: Job.objects.get(pk=job.pk).status in Job.TERMINAL, timeout=30, what="the job to end")
        assert Job.objects.get(pk=job.pk).status == "done"
        worker.terminate()
        worker.wait(timeout=20)
        assert KEY not in worker.log_path.read_text()
        connection.close()


@pytest.mark.django_db
class TestTheMigration:
    def test_plain_secrets_move_sealed_and_the_same_credentials_are_sent(self):
        """Rows as they could be stored before: the migration's step leaves no secret in clear,
        and the headers the driver sends are those it sent (aiohttp made Basic credentials of the
        URL's user and password)."""
        migration = importlib.import_module("executors.migrations.0008_sealed_secrets")
        Executor.objects.create(
            name="basic",
            kind="local-model",
            endpoint="https://alice:p%40ss-w0rd@llm.example:8443/v1?api-version=2024&api_key=qs-secret",
            transport={"timeout_s": 5, "headers": {"api-key": HEADER_KEY}},
            meta={"api_key": KEY, "owner": "ml", "nested": {"password": "pw-secret"}},
        )
        Executor.objects.create(
            name="keyed",
            kind="remote-model",
            endpoint="http://127.0.0.1:9/v1",
            transport={"api_key_env": "K", "api_key": OTHER, "auth": {"token": "tk-secret"}},
        )
        Executor.objects.create(name="clean", kind="sim", transport={"timeout_s": 5}, meta={"latency_ms": 0})
        from django.apps import apps

        migration.plain_secrets_sealed(apps, None)

        for name in ("basic", "keyed", "clean"):
            row = raw_row(name)
            for secret in (KEY, OTHER, HEADER_KEY, "p@ss-w0rd", "p%40ss-w0rd", "qs-secret", "pw-secret", "tk-secret"):
                assert secret not in row, (name, secret)
        basic = Executor.objects.get(name="basic")
        assert basic.endpoint == "https://llm.example:8443/v1?api-version=2024"
        assert basic.meta == {"owner": "ml", "nested": {}}
        sent = transport_headers(basic.transport, executor="basic")
        assert sent == {"api-key": HEADER_KEY, "Authorization": aiohttp.encode_basic_auth("alice", "p@ss-w0rd")}
        secrets = basic.transport["secrets"]
        assert {secret_unseal(secrets[name]["sealed"]) for name in secrets} == {"qs-secret", KEY, "pw-secret"}
        assert set(secrets) == {"endpoint.api_key", "meta.api_key", "meta.nested.password"}

        keyed = Executor.objects.get(name="keyed")
        assert set(keyed.transport["secrets"]) == {"api_key", "transport.auth"}
        assert keyed.transport["api_key_env"] == "K" and "api_key" not in keyed.transport
        assert json.loads(secret_unseal(keyed.transport["secrets"]["transport.auth"]["sealed"])) == {
            "token": "tk-secret"
        }
        assert Executor.objects.get(name="clean").transport == {"timeout_s": 5}

        before = raw_row("basic")
        migration.plain_secrets_sealed(apps, None)  # again: nothing moves twice
        assert raw_row("basic") == before

    def test_the_move_itself(self):
        endpoint, transport, meta = plain_secrets_moved(
            endpoint="http://u:p@h/v1", transport={"api_key_env": "K"}, meta={}
        )
        assert endpoint == "http://h/v1" and meta == {}
        assert (
            secret_unseal(transport["secrets"]["endpoint.userinfo"]["sealed"]) == f"Basic {b64encode(b'u:p').decode()}"
        )


@pytest.mark.django_db
class TestKeys:
    FIRST, SECOND = Fernet.generate_key().decode(), Fernet.generate_key().decode()

    def test_rotation_reseals_under_the_new_key(self, api, operator):
        with override_settings(TELEMACHUS_SECRETS_KEY=self.FIRST):
            api(operator).post("/api/executors/", {**BODY, "transport": {"api_key": KEY}}, format="json")
            shown = transport_shown(stored())["api_key"]
        with override_settings(TELEMACHUS_SECRETS_KEY=self.SECOND), pytest.raises(SecretUnreadable):
            secret_unseal(stored()["api_key"]["sealed"])
        with override_settings(TELEMACHUS_SECRETS_KEY=f"{self.SECOND},{self.FIRST}"):
            call_command("executor_secrets_rotate", stdout=(out := io.StringIO()))
            assert "Resealed the secrets of 1 executor(s): hosted" in out.getvalue()
        with override_settings(TELEMACHUS_SECRETS_KEY=self.SECOND):
            assert secret_unseal(stored()["api_key"]["sealed"]) == KEY
            assert transport_shown(stored())["api_key"] == shown  # the mask does not change
        assert AuditEvent.objects.filter(action="executor.secrets_rotate", object_repr="hosted").count() == 1

    def test_without_a_secrets_key_the_old_secret_key_still_unseals(self, api, operator, settings):
        api(operator).post("/api/executors/", {**BODY, "transport": {"api_key": KEY}}, format="json")
        old = settings.SECRET_KEY
        with override_settings(SECRET_KEY="a-new-secret-key-0123456789-abcdefghij", SECRET_KEY_FALLBACKS=[old]):
            assert secret_unseal(stored()["api_key"]["sealed"]) == KEY
        with override_settings(TELEMACHUS_SECRETS_KEY=self.FIRST):  # set later: the derived key still unseals
            assert secret_unseal(stored()["api_key"]["sealed"]) == KEY
