"""The OpenAI-compatible drivers against real servers on 127.0.0.1: simllm and the fault server."""

import asyncio

import pytest

from executors.contract import DispatchError, DispatchRequest
from executors.drivers import openai as openai_driver
from executors.drivers.openai import LocalModelDriver, RemoteModelDriver
from executors.models import Executor
from tests.processes import free_port, http_json, wait_until

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "say something"}]


def request(job_id: int = 1, **input_options) -> DispatchRequest:
    return DispatchRequest(job_id=job_id, type="chat", model="m", input={"messages": MESSAGES, **input_options})


def driver(endpoint: str, *, kind: str = "local-model", **transport) -> LocalModelDriver:
    executor = Executor(name="x", kind=kind, endpoint=endpoint, capabilities={"models": ["m"]}, transport=transport)
    return (RemoteModelDriver if kind == "remote-model" else LocalModelDriver)(executor)


def run(coro):
    return asyncio.run(coro)


async def dispatch(d: LocalModelDriver, req: DispatchRequest, deltas: list | None = None, tools: list | None = None):
    async def sink(text: str, *, tool: tuple[int, str, str] | None = None) -> None:
        if tool is None:
            deltas.append(text)
        elif tools is not None:
            tools.append((*tool, text))

    try:
        return await d.execute(req, sink if deltas is not None else None)
    finally:
        await d.aclose()


@pytest.fixture
def simllm(processes):
    return processes.simllm(latency_ms=0, models="m", output_tokens=5)


@pytest.fixture
def faults(processes):
    return processes.faultserver(FAULT_EXPECTED_KEY="sk-test-0123456789")


class TestAgainstSimllm:
    def test_plain_completion_with_usage(self, simllm):
        result = run(dispatch(driver(f"{simllm}/v1"), request(max_tokens=3)))
        assert result.output["message"]["content"].startswith("[simulated by simllm]")
        assert (result.prompt_tokens, result.completion_tokens) == (6, 3)

    def test_stream_relays_deltas_and_takes_usage_from_the_last_chunk(self, simllm):
        deltas: list[str] = []
        result = run(dispatch(driver(f"{simllm}/v1"), request(stream=True, max_tokens=4), deltas))
        assert deltas == ["[simulated by simllm]", " sim0", " sim1", " sim2", " sim3"]
        assert result.output["message"]["content"] == "".join(deltas)
        assert result.output["usage_counted"] is False
        assert (result.prompt_tokens, result.completion_tokens) == (6, 4)

    def test_tool_calls_pass_through_plain_and_streamed(self, simllm):
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "parameters": {
                        "type": "object",
                        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                    },
                },
            }
        ]
        plain = run(dispatch(driver(f"{simllm}/v1"), request(tools=tools)))
        pieces: list = []
        streamed = run(dispatch(driver(f"{simllm}/v1"), request(tools=tools, stream=True), [], pieces))
        for result in (plain, streamed):
            (call,) = result.output["message"]["tool_calls"]
            assert call["function"] == {"name": "lookup", "arguments": '{"query": "say something", "limit": 2}'}
            assert call["id"].startswith("call_") and result.output["finish_reason"] == "tool_calls"
        assert plain.output["message"]["tool_calls"][0]["id"] == streamed.output["message"]["tool_calls"][0]["id"]
        # Streamed, the call's pieces went to the sink as they came: its id and name, then its arguments
        ident = streamed.output["message"]["tool_calls"][0]["id"]
        assert len(pieces) > 3 and all(piece[:3] == (0, ident, "lookup") for piece in pieces)
        assert pieces[0][3] == "" and "".join(piece[3] for piece in pieces) == '{"query": "say something", "limit": 2}'

    def test_embeddings(self, simllm):
        embed = DispatchRequest(
            job_id=1,
            type="chat",
            model="m",
            input={"input": ["one two", "three"]},
            requirements={"model": "m", "api": "embeddings"},
        )
        result = run(dispatch(driver(f"{simllm}/v1"), embed))
        assert [item["index"] for item in result.output["data"]] == [0, 1]
        assert len(result.output["data"][0]["embedding"]) == 16 and result.prompt_tokens == 3
        again = run(dispatch(driver(f"{simllm}/v1"), embed))
        assert again.output["data"] == result.output["data"], "the same text embeds the same"

    def test_list_models_and_probe(self, simllm):
        async def scenario():
            d = driver(f"{simllm}/v1")
            try:
                return await d.list_models(), await d.probe()
            finally:
                await d.aclose()

        models, probe = run(scenario())
        assert models == ["m"]
        assert probe.health == "ok" and probe.models == ["m"] and probe.latency_ms is not None

    def test_probe_degraded_when_a_configured_model_is_missing(self, simllm):
        d = driver(f"{simllm}/v1")
        d.executor.capabilities = {"models": ["m", "llama-70b"]}
        probe = run(d.probe())
        assert probe.health == "degraded" and "llama-70b" in probe.detail

    def test_fail_rate_answers_500(self, processes):
        base = processes.simllm(latency_ms=0, fail_rate=1)
        with pytest.raises(DispatchError) as caught:
            run(dispatch(driver(f"{base}/v1"), request()))
        assert caught.value.retryable and "answered 500" in str(caught.value)

    def test_cancel_stops_the_upstream_request(self, processes):
        base = processes.simllm(latency_ms=0, tokens_per_s=2, output_tokens=100)
        d = driver(f"{base}/v1")

        async def scenario():
            task = asyncio.create_task(d.execute(request(job_id=7, stream=True)))
            while http_json(f"{base}/stats")["in_flight"] == 0:
                await asyncio.sleep(0.05)
            assert await d.cancel(7)
            with pytest.raises(asyncio.CancelledError):
                await task
            await d.aclose()

        run(scenario())
        wait_until(
            lambda: http_json(f"{base}/stats")["disconnects"] == 1, timeout=5, what="the server to see the hang-up"
        )
        assert http_json(f"{base}/stats")["in_flight"] == 0


class TestFaults:
    @pytest.mark.parametrize(
        ("mode", "retryable", "fault", "text"),
        [
            ("500", True, True, "answered 500: upstream says 500"),
            ("502", True, True, "answered 502"),
            ("503", True, True, "answered 503"),
            ("400", False, False, "answered 400: upstream says 400"),
            ("401", False, False, "answered 401"),
            ("403", False, False, "answered 403"),
            ("404model", False, False, "answered 404: The model 'm' does not exist"),
            ("malformed", True, True, "malformed completion"),
            ("nan", True, True, "malformed completion"),
        ],
    )
    def test_status_classification(self, faults, mode, retryable, fault, text):
        with pytest.raises(DispatchError) as caught:
            run(dispatch(driver(f"{faults}/{mode}/v1"), request()))
        assert caught.value.retryable is retryable
        assert caught.value.executor_fault is fault
        assert text in str(caught.value)

    def test_a_stream_line_longer_than_the_read_buffer_is_read_whole(self, faults):
        deltas: list[str] = []
        result = run(dispatch(driver(f"{faults}/bigline/v1"), request(stream=True), deltas))
        assert deltas == ["x" * 400_000] and result.output["message"]["content"] == "x" * 400_000

    def test_429_is_retryable_with_retry_after_and_not_the_executors_fault(self, faults):
        with pytest.raises(DispatchError) as caught:
            run(dispatch(driver(f"{faults}/429/v1"), request()))
        assert caught.value.retryable and not caught.value.executor_fault
        assert caught.value.retry_after == 1.0 and caught.value.status == 429

    def test_slow_probe_is_degraded(self, faults, monkeypatch):
        monkeypatch.setattr(openai_driver, "SLOW_PROBE_MS", 300)
        assert run(driver(f"{faults}/ok/v1").probe()).health == "ok"
        probe = run(driver(f"{faults}/slow/v1").probe())
        assert probe.health == "degraded" and probe.detail.startswith("slow: ") and probe.latency_ms >= 500

    def test_hang_past_the_timeout(self, faults):
        with pytest.raises(DispatchError) as caught:
            run(dispatch(driver(f"{faults}/hang/v1", timeout_s=0.5), request()))
        assert "timed out" in str(caught.value) and caught.value.retryable and caught.value.executor_fault

    def test_refused_port(self):
        with pytest.raises(DispatchError) as caught:
            run(dispatch(driver(f"http://127.0.0.1:{free_port()}/v1"), request()))
        assert "unreachable" in str(caught.value) and caught.value.retryable and caught.value.executor_fault

    def test_probe_of_a_refused_port_is_down(self):
        probe = run(driver(f"http://127.0.0.1:{free_port()}/v1").probe())
        assert probe.health == "down" and "unreachable" in probe.detail

    def test_connection_reset_mid_stream(self, faults):
        deltas: list[str] = []
        with pytest.raises(DispatchError) as caught:
            run(dispatch(driver(f"{faults}/reset/v1"), request(stream=True), deltas))
        assert deltas == ["partial"]
        assert caught.value.retryable and caught.value.executor_fault

    def test_stream_without_usage_is_counted(self, faults):
        deltas: list[str] = []
        result = run(dispatch(driver(f"{faults}/nousage/v1"), request(stream=True), deltas))
        assert "".join(deltas) == "one two three"
        assert result.output["usage_counted"] is True
        assert (result.prompt_tokens, result.completion_tokens) == (6, 3)


class TestRemoteModel:
    def test_sends_the_key_from_the_named_environment_variable(self, faults, monkeypatch):
        monkeypatch.setenv("TEST_REMOTE_KEY", "sk-test-0123456789")
        result = run(
            dispatch(driver(f"{faults}/auth/v1", kind="remote-model", api_key_env="TEST_REMOTE_KEY"), request())
        )
        assert result.output["message"]["content"] == "ok from auth"

    def test_the_key_is_redacted_from_upstream_errors(self, faults, monkeypatch):
        monkeypatch.setenv("TEST_REMOTE_KEY", "sk-wrong-key-987")
        with pytest.raises(DispatchError) as caught:
            run(dispatch(driver(f"{faults}/auth/v1", kind="remote-model", api_key_env="TEST_REMOTE_KEY"), request()))
        assert "answered 401: invalid credentials: Bearer ***" in str(caught.value)
        assert "sk-wrong-key-987" not in str(caught.value)

    def test_missing_variable_fails_without_retry(self, faults, monkeypatch):
        monkeypatch.delenv("TEST_REMOTE_KEY", raising=False)
        with pytest.raises(DispatchError) as caught:
            run(dispatch(driver(f"{faults}/auth/v1", kind="remote-model", api_key_env="TEST_REMOTE_KEY"), request()))
        assert "TEST_REMOTE_KEY" in str(caught.value) and not caught.value.retryable
