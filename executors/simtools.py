"""Deterministic tool calls for the simulators (the `sim` driver and `simllm`), so flows can be
tested and demonstrated without a real model. Free of Django, so simllm can use it.

The rules, asked with tools (and a `tool_choice` other than "none"; a named choice picks the
tool, else the first is called, one call per reply):
- a conversation whose user or system text holds `[rounds:N]`: call until N-1 tool results are in
  the conversation, then answer in plain text, so a flow whose prompt says `[rounds:20]` takes
  exactly 20 rounds. The arguments are `{"round": k}` (k counts the calls, from 1), fitted to the
  tool's schema: a schema that forbids unknown properties does not get `round`, and each required
  property gets a placeholder of its type;
- any other conversation: call once, as a model given tools would, unless the last message is a
  tool's result, which is answered. Each declared string argument gets the last user message, each
  number its word count, each boolean true (so an SDK user sees `{"city": "Paris"}` for "Paris").
Without tools the simulators answer at once.
"""

import hashlib
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


def sim_tool_calls(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, tool_choice: Any = "auto"
) -> list[dict[str, Any]]:
    """The tool calls the simulated model makes next ([] means: answer now)."""
    functions = [t["function"] for t in tools or () if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if not functions or tool_choice == "none":
        return []
    named = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    function = next((f for f in functions if f.get("name") == named), functions[0])
    results = sum(1 for m in messages if m.get("role") == "tool")
    wanted = rounds_wanted(messages)
    if wanted is None:
        if messages and messages[-1].get("role") == "tool":
            return []
        arguments = said_arguments(function.get("parameters"), messages)
        ident = "call_" + hashlib.sha256(f"{function.get('name')}:{json.dumps(arguments)}".encode()).hexdigest()[:24]
    else:
        if results >= wanted - 1:
            return []
        arguments = sample_arguments(function.get("parameters"), call=results + 1)
        ident = f"call_{results + 1}"
    return [
        {
            "id": ident,
            "type": "function",
            "function": {"name": str(function.get("name", "")), "arguments": json.dumps(arguments)},
        }
    ]


def said_arguments(schema: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Arguments made from the last user message (see the module docstring)."""
    said = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")
    kinds = {"string": said, "integer": len(said.split()), "number": len(said.split()), "boolean": True}
    properties = (schema if isinstance(schema, dict) else {}).get("properties") or {}
    return {
        name: kinds.get((spec or {}).get("type") if isinstance(spec, dict) else None, said)  # type: ignore[arg-type]
        for name, spec in properties.items()
    }


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
