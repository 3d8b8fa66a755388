"""Deterministic tool calls for the simulators (the `sim` driver and `simllm`), so flows can be
tested and demonstrated without a real model. Free of Django, so simllm can use it.

The rule: asked with tools and a conversation whose user or system text holds `[rounds:N]`, call
the first tool (one call per reply) until N-1 tool results are in the conversation, then answer
in plain text. So a flow whose prompt says `[rounds:20]` takes exactly 20 rounds. Without tools,
or without the marker, the simulators answer at once. The arguments are `{"round": k}` (k counts
the calls, from 1), fitted to the tool's schema: a schema that forbids unknown properties does not
get `round`, and each required property gets a placeholder of its type.
"""

import json
import re
from typing import Any

ROUNDS_MARKER = re.compile(r"\[rounds:(\d+)\]")
PLACEHOLDERS = {"string": "sim", "integer": 0, "number": 0, "boolean": False, "array": [], "object": {}}


def rounds_wanted(messages: list[dict[str, Any]]) -> int | None:
    """N from the first `[rounds:N]` in a user or system message, if any."""
    for message in messages:
        if message.get("role") in ("user", "system", "developer"):
            found = ROUNDS_MARKER.search(str(message.get("content") or ""))
            if found:
                return int(found.group(1))
    return None


def sim_tool_calls(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The tool calls the simulated model makes next ([] means: answer now)."""
    wanted = rounds_wanted(messages) if tools else None
    if wanted is None:
        return []
    results = sum(1 for m in messages if m.get("role") == "tool")
    if results >= wanted - 1:
        return []
    function = (tools[0].get("function") or {}) if isinstance(tools[0], dict) else {}
    arguments = sample_arguments(function.get("parameters"), call=results + 1)
    return [{
        "id": f"call_{results + 1}",
        "type": "function",
        "function": {"name": function.get("name", ""), "arguments": json.dumps(arguments)},
    }]


def sample_arguments(schema: Any, *, call: int) -> dict[str, Any]:
    """`{"round": call}` fitted to an object schema (see the module docstring)."""
    schema = schema if isinstance(schema, dict) else {}
    properties = schema.get("properties") or {}
    arguments: dict[str, Any] = {}
    if schema.get("additionalProperties", True) is not False or "round" in properties:
        arguments["round"] = call
    for name in schema.get("required") or ():
        if name not in arguments:
            kind = (properties.get(name) or {}).get("type", "string")
            arguments[name] = PLACEHOLDERS.get(kind if isinstance(kind, str) else "string", "sim")
    return arguments

