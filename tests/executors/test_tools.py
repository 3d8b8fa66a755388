"""The tool registry: built-ins, tools added through settings, schemas, errors, timeouts; and the
simulators' deterministic tool calls."""

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.core.exceptions import ImproperlyConfigured

from executors.contract import DispatchRequest
from executors.drivers.sim import SimDriver
from executors.models import Executor
from executors.simtools import sample_arguments, sim_tool_calls
from executors.tools import Tool, ToolError, UnknownTool, tool, tool_call, tool_invoke, tool_resolve

MODULE = __name__
released = threading.Event()


# --- tools a deployment might register ------------------------------------------------------------


@tool(
    parameters={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    timeout_s=2,
)
def add(a: int, b: int) -> dict:
    """Adds two integers."""
    return {"sum": a + b}


@tool(timeout_s=2)
def boom(**_) -> None:
    raise ValueError("no such thing")


@tool(timeout_s=0.2)
def hang(**_) -> None:
    released.wait(5)


@tool(timeout_s=30)
def nap(seconds: float = 10, **_) -> dict:
    time.sleep(seconds)
    return {"slept": seconds}


@tool()
def not_json(**_) -> set:
    return {1, 2}


not_a_tool = len
bad_schema = Tool(name="bad", fn=len, parameters={"type": "nonsense"})


def invoke(name: str, arguments, **kwargs):
    threads = ThreadPoolExecutor(2)
    try:
        return asyncio.run(tool_invoke(name=name, arguments=arguments, call_id="c1", threads=threads, **kwargs))
    finally:
        threads.shutdown(wait=False)  # an abandoned call keeps its thread; the test does not wait for it


@pytest.fixture
def toolbox(settings):
    settings.TELEMACHUS_TOOLS = [f"{name}={MODULE}.{name}" for name in ("add", "boom", "hang", "not_json")]


class TestRegistry:
    def test_builtins_declare_schemas_in_openai_format(self):
        echo = tool_resolve(name="echo")
        assert echo.schema()["type"] == "function"
        assert echo.schema()["function"]["name"] == "echo"
        assert echo.schema()["function"]["parameters"]["type"] == "object"
        assert json.loads(tool_call(echo, {"x": [1, "two"]})) == {"x": [1, "two"]}
        assert "utc" in json.loads(tool_call(tool_resolve(name="clock"), {}))

    def test_a_setting_adds_tools_under_the_name_it_gives(self, settings):
        settings.TELEMACHUS_TOOLS = [f"sum={MODULE}.add"]
        found = tool_resolve(name="sum")
        assert found.name == "sum" and found.description == "Adds two integers." and found.timeout_s == 2
        assert json.loads(tool_call(found, {"a": 2, "b": 3})) == {"sum": 5}

    def test_unknown_names_and_broken_registrations(self, settings):
        with pytest.raises(UnknownTool, match="unknown tool 'nope'; registered tools: clock, echo"):
            tool_resolve(name="nope")
        settings.TELEMACHUS_TOOLS = ["x=no.such.module", f"y={MODULE}.not_a_tool", f"z={MODULE}.bad_schema"]
        for name, message in (("x", "cannot import"), ("y", "is not a Tool"), ("z", "not a JSON schema")):
            with pytest.raises(ImproperlyConfigured, match=message):
                tool_resolve(name=name)
        settings.TELEMACHUS_TOOLS = ["broken"]
        with pytest.raises(ImproperlyConfigured, match="is not name=dotted.path"):
            tool_resolve(name="echo")


class TestCalls:
    def test_arguments_are_checked_against_the_schema(self, toolbox):
        found = tool_resolve(name="add")
        with pytest.raises(ToolError, match="invalid arguments at b: 'x' is not of type 'integer'"):
            tool_call(found, {"a": 1, "b": "x"})
        with pytest.raises(ToolError, match="'b' is a required property"):
            tool_call(found, {"a": 1})
        with pytest.raises(ToolError, match="must be a JSON object"):
            tool_call(found, [1, 2])

    def test_invoke_reports_every_failure_as_an_outcome(self, toolbox):
        assert invoke("add", '{"a": 1, "b": 2}').content == '{"sum": 3}'
        for name, arguments, message in (
            ("boom", "{}", "tool 'boom' raised ValueError: no such thing"),
            ("not_json", "{}", "returned a value that is not JSON"),
            ("add", "{not json", "arguments are not JSON"),
            ("nope", "{}", "unknown tool 'nope'"),
        ):
            outcome = invoke(name, arguments)
            assert not outcome.ok and message in outcome.content, (name, outcome)

    def test_a_tool_past_its_timeout_fails_the_call(self, toolbox):
        started = time.monotonic()
        outcome = invoke("hang", {})
        released.set()
        assert not outcome.ok and outcome.content == "tool 'hang' timed out after 0.2s"
        assert time.monotonic() - started < 4

    def test_a_flow_may_call_only_the_tools_it_listed(self):
        outcome = invoke("clock", {}, allowed={"echo"})
        assert not outcome.ok and "not one this flow may call (echo)" in outcome.content


class TestSimulatedToolCalls:
    TOOLS = [tool_resolve(name="echo").schema(), tool_resolve(name="clock").schema()]

    def conversation(self, n_results: int, prompt: str = "work [rounds:3]") -> list[dict]:
        messages = [{"role": "user", "content": prompt}]
        for k in range(1, n_results + 1):
            messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{k}"}]})
            messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": "{}"})
        return messages

    def test_rounds_marker_calls_the_first_tool_until_n_minus_one_results(self):
        first = sim_tool_calls(self.conversation(0), self.TOOLS)
        assert first == [
            {"id": "call_1", "type": "function", "function": {"name": "echo", "arguments": '{"round": 1}'}}
        ]
        assert sim_tool_calls(self.conversation(1), self.TOOLS)[0]["id"] == "call_2"
        assert sim_tool_calls(self.conversation(2), self.TOOLS) == []

    def test_no_tools_or_tool_choice_none_means_an_answer(self):
        assert sim_tool_calls(self.conversation(0), None) == []
        assert sim_tool_calls(self.conversation(0), self.TOOLS, "none") == []

    def test_without_the_marker_a_tool_is_called_once_then_its_result_answered(self):
        weather = [
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    },
                },
            }
        ]
        (call,) = sim_tool_calls(self.conversation(0, prompt="Paris tomorrow"), weather)
        assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris tomorrow", "days": 2}'}
        assert sim_tool_calls(self.conversation(1, prompt="Paris tomorrow"), weather) == []

    def test_a_named_tool_choice_picks_the_tool(self):
        chosen = sim_tool_calls(self.conversation(0), self.TOOLS, {"type": "function", "function": {"name": "clock"}})
        assert chosen[0]["function"]["name"] == "clock"

    def test_arguments_fit_the_schema(self):
        strict = {
            "type": "object",
            "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["city", "n"],
            "additionalProperties": False,
        }
        assert sample_arguments(strict, call=2) == {"city": "sim", "n": 0}
        assert sample_arguments({"type": "object"}, call=2) == {"round": 2}

    def test_the_sim_driver_answers_with_tool_calls(self):
        executor = Executor(name="s", kind="sim", capabilities={"models": ["m"]}, meta={"latency_ms": 0})
        request = DispatchRequest(
            job_id=1, type="flow", model="m", input={"messages": self.conversation(0), "tools": self.TOOLS}
        )
        result = asyncio.run(SimDriver(executor).dispatch(request))
        assert result.output["finish_reason"] == "tool_calls"
        assert result.output["message"]["tool_calls"][0]["function"]["name"] == "echo"
        assert result.output["message"]["content"] is None
