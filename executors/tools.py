"""The tools that flows and tool jobs may call, by name.

A tool is a Python function with a JSON schema for its arguments and a timeout. A model asks for a
tool by name (an OpenAI `tool_calls` entry); only tools registered here run, so neither a job nor a
model can make a worker import arbitrary code. Two are built in: `echo` (returns its arguments) and
`clock` (the time, UTC). A deployment adds its own with TELEMACHUS_TOOLS = "name=dotted.path,..."
where the path names a `Tool`, usually made with the `@tool(...)` decorator:

    from executors.tools import tool

    @tool(parameters={"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"]}, timeout_s=5)
    def weather(city: str) -> dict:
        "Today's weather in a city."
        return {"city": city, "sky": "clear"}

The function is called with the arguments as keyword arguments, after they are checked against
the schema; what it returns must be JSON, and becomes the tool result (a `role: tool` message in a
flow, the `result` of a tool job). Tools run in the worker's tool threads, never on a model slot
and never inside a database transaction. A tool that runs past its timeout is abandoned: its
result is dropped and the call fails, but Python cannot stop a thread, so the function runs on to
its end in the background. A tool may run more than once for one call (its worker died between
running it and recording the result), as a task may: make tools safe to repeat.
"""

import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import jsonschema
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections
from django.utils.module_loading import import_string

DEFAULT_TIMEOUT_S = 10.0
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class UnknownTool(LookupError):
    """A job or a model named a tool that nobody registered."""


class ToolError(Exception):
    """A tool call that failed: bad arguments, the tool raised, timed out, or returned non-JSON.
    The message is what the flow's error (or the tool result passed back to the model) says."""


@dataclass(frozen=True)
class Tool:
    """A callable a model may call: its name, what it does, the JSON schema of its arguments (an
    object), and how long a call may take."""

    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: dict(ANY_OBJECT))
    timeout_s: float = DEFAULT_TIMEOUT_S

    def schema(self) -> dict[str, Any]:
        """The tool as the OpenAI chat API's `tools` list wants it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def __call__(self, **arguments: Any) -> Any:
        return self.fn(**arguments)


def tool(
    *,
    parameters: dict[str, Any] | None = None,
    description: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    name: str | None = None,
) -> Callable[[Callable[..., Any]], Tool]:
    """Make a function a Tool (its name and docstring are the defaults for the tool's)."""

    def wrap(fn: Callable[..., Any]) -> Tool:
        return Tool(
            name=name or fn.__name__,
            fn=fn,
            description=description or (fn.__doc__ or "").strip(),
            parameters=parameters or dict(ANY_OBJECT),
            timeout_s=timeout_s,
        )

    return wrap


# --- built-in tools ---------------------------------------------------------------------------


@tool(parameters={"type": "object", "additionalProperties": True}, timeout_s=5)
def echo(**arguments: Any) -> dict[str, Any]:
    """Returns its arguments as they came: for demos and for testing flows end to end."""
    return arguments


@tool(parameters={"type": "object", "properties": {}}, timeout_s=5)
def clock(**_: Any) -> dict[str, str]:
    """The current date and time, UTC, in ISO 8601."""
    return {"utc": datetime.now(UTC).isoformat()}


BUILTIN_TOOLS = {"echo": "executors.tools.echo", "clock": "executors.tools.clock"}


# --- the registry -----------------------------------------------------------------------------


def tool_paths() -> dict[str, str]:
    """Tool name -> dotted path: the built-ins, then TELEMACHUS_TOOLS in order (an entry may
    replace a built-in). Read from settings on every lookup, like the task registry."""
    paths = dict(BUILTIN_TOOLS)
    for entry in settings.TELEMACHUS_TOOLS:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ImproperlyConfigured(f"TELEMACHUS_TOOLS entry {entry!r} is not name=dotted.path")
        paths[name.strip()] = path.strip()
    return paths


def tool_resolve(*, name: str) -> Tool:
    """The tool registered as `name`, under that name. Raises UnknownTool for a name nobody
    registered (the job's or the model's fault), ImproperlyConfigured for a broken registration
    (a path that does not import, something that is not a Tool, a schema that is not a schema)."""
    paths = tool_paths()
    try:
        path = paths[name]
    except KeyError:
        raise UnknownTool(f"unknown tool {name!r}; registered tools: {', '.join(sorted(paths))}") from None
    try:
        found = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(f"tool {name!r}: cannot import {path}: {exc}") from exc
    if not isinstance(found, Tool):
        raise ImproperlyConfigured(f"tool {name!r}: {path} is not a Tool (decorate it with executors.tools.tool)")
    if _schema_checked.get(path) is not found:
        try:
            jsonschema.validators.validator_for(found.parameters).check_schema(found.parameters)
        except jsonschema.SchemaError as exc:
            raise ImproperlyConfigured(f"tool {name!r}: its parameters are not a JSON schema: {exc.message}") from exc
        _schema_checked[path] = found
    return replace(found, name=name)


# Tools whose parameters passed the schema check, by path: a flow resolves its tools every round
# (and again for each call), and checking a schema costs more than the round's other work on the
# worker's event loop. The import gives the same object until the module is reloaded.
_schema_checked: dict[str, Tool] = {}


def tool_arguments_check(tool: Tool, arguments: Any) -> None:
    """Raise ToolError unless `arguments` is an object that fits the tool's schema."""
    if not isinstance(arguments, dict):
        raise ToolError(f"tool {tool.name!r}: arguments must be a JSON object, not {type(arguments).__name__}")
    error = jsonschema.exceptions.best_match(
        jsonschema.validators.validator_for(tool.parameters)(tool.parameters).iter_errors(arguments)
    )
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        raise ToolError(f"tool {tool.name!r}: invalid arguments{f' at {where}' if where else ''}: {error.message}")


def tool_call(tool: Tool, arguments: Any) -> str:
    """Check the arguments, call the tool, and return its result as JSON text. Raises ToolError.
    Runs in a tool thread: it may use the ORM, on a connection of that thread's own."""
    tool_arguments_check(tool, arguments)
    close_old_connections()
    try:
        value = tool(**arguments)
    except Exception as exc:
        raise ToolError(f"tool {tool.name!r} raised {type(exc).__name__}: {exc}") from exc
    finally:
        close_old_connections()
    try:
        # allow_nan=False: NaN and Infinity are not JSON, and PostgreSQL's jsonb refuses them.
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ToolError(f"tool {tool.name!r} returned a value that is not JSON: {exc}") from exc


@dataclass(frozen=True)
class ToolOutcome:
    """One tool call, run: its result as JSON text, or the error that stopped it."""

    name: str
    call_id: str
    ok: bool
    content: str
    seconds: float

    def describe(self) -> dict[str, Any]:
        """For events: what ran, how long, and whether it worked (not the content)."""
        return {
            "name": self.name,
            "ok": self.ok,
            "seconds": round(self.seconds, 4),
            **({} if self.ok else {"error": self.content[:500]}),
        }


async def tool_invoke(
    *, name: str, arguments: Any, call_id: str = "", threads: Executor, allowed: set[str] | None = None
) -> ToolOutcome:
    """Run one tool call in `threads` (never on the event loop), within the tool's timeout. A
    `tool_calls` entry's arguments arrive as JSON text and are parsed here. `allowed` limits the
    names (a flow may call only the tools it listed). Never raises for the call's own failure:
    the outcome says what went wrong."""
    started = time.perf_counter()

    def failed(message: str) -> ToolOutcome:
        return ToolOutcome(name=name, call_id=call_id, ok=False, content=message, seconds=time.perf_counter() - started)

    try:
        if allowed is not None and name not in allowed:
            raise UnknownTool(f"tool {name!r} is not one this flow may call ({', '.join(sorted(allowed)) or 'none'})")
        found = tool_resolve(name=name)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as exc:
                raise ToolError(f"tool {name!r}: arguments are not JSON: {exc}") from exc
        future = asyncio.get_running_loop().run_in_executor(threads, tool_call, found, arguments)
        try:
            content = await asyncio.wait_for(future, timeout=found.timeout_s)
        except TimeoutError:
            raise ToolError(f"tool {name!r} timed out after {found.timeout_s:g}s") from None
    except (UnknownTool, ToolError, ImproperlyConfigured) as exc:
        return failed(str(exc))
    return ToolOutcome(name=name, call_id=call_id, ok=True, content=content, seconds=time.perf_counter() - started)
