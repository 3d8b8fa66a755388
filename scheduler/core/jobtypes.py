"""What each job type asks of an executor, and what becomes its result.

  chat       `input.messages` (and options such as max_tokens) as they are; result: the model's.
  translate  `input = {text, target_lang, source_lang?}` becomes a chat with TRANSLATE_SYSTEM and
             the text as the user message; result `{"text": <the reply>, "model": ...}`.
  flow       `input = {messages, tools: [names], max_rounds, return_tool_errors, stream?}`: each round
             sends the conversation so far with the tools' JSON schemas in OpenAI `tools` format
             (scheduler/flows/runner.py runs the rounds); with `stream`, each round's call streams,
             and its text and tool-call pieces go to the job's stream, tagged with the round.
  tool       `input = {tool, arguments}`: no executor; the tool runs in the worker's tool threads.
  task       a cpu-node executor's (executors/drivers/cpu.py).

The submit checks what the serializer cannot: that named tools exist, fit their schemas, and that
the principal may invoke them (`job_input_check`).
"""

from collections.abc import Callable
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from executors.contract import DispatchRequest
from executors.registry import kind_chats, kind_runs_tasks
from executors.tools import Tool, ToolError, UnknownTool, tool_arguments_check, tool_resolve
from scheduler.models import Job
from telemachus.errors import Forbidden, ValidationFailed
from telemachus.models import Team
from telemachus.teams import rbac

TRANSLATE_SYSTEM = (
    "You are a translator. Translate the user's message{source} into {target}. "
    "Reply with the translation only: no notes, no quotes, no explanation."
)
# The feature switch (telemachus/control/features.py) each job type answers to: its own, but a
# governed slot is a flow's model call made by app code, so it is a flow's.
JOB_TYPE_FEATURE: dict[str, str] = {Job.Type.GOVERNED: Job.Type.FLOW}


def job_feature(type: str) -> str:
    """The feature switch that turns jobs of this type off."""
    return str(JOB_TYPE_FEATURE.get(type, type))


# The job types that call a model, on an executor whose driver answers model calls
# (ExecutorDriver.chat: local-model, remote-model, sim); a cpu-node's models name task queues and
# take none of them. A governed slot is app code's own model call.
MODEL_CALL_TYPES = frozenset({Job.Type.CHAT, Job.Type.TRANSLATE, Job.Type.FLOW, Job.Type.GOVERNED})
# The job types that run on an executor whose driver runs tasks (ExecutorDriver.tasks: cpu-node, hpc-partition);
# a model server would take a task's input for a chat completion.
TASK_TYPES = frozenset({Job.Type.TASK})


def kind_serves(kind: str, job_type: str) -> bool:
    """Whether an executor of this kind may run a job of this type (a tool job runs on none)."""
    if job_type in MODEL_CALL_TYPES:
        return kind_chats(kind)
    if job_type in TASK_TYPES:
        return kind_runs_tasks(kind)
    return False


# Input keys that steer the scheduler, never sent to a model server. A flow's `stream` stays: it
# makes each round's model call a streamed one, relayed to the job's stream.
FLOW_ONLY = ("messages", "tools", "max_rounds", "return_tool_errors")
TRANSLATE_ONLY = ("text", "target_lang", "source_lang", "messages", "stream")


def translate_messages(*, text: str, target_lang: str, source_lang: str | None = None) -> list[dict[str, str]]:
    """The documented translate template: a system message naming the languages, then the text."""
    source = f" from {source_lang}" if source_lang else ""
    return [
        {"role": "system", "content": TRANSLATE_SYSTEM.format(source=source, target=target_lang)},
        {"role": "user", "content": text},
    ]


def job_request(job: Job, *, messages: list[dict[str, Any]] | None = None) -> DispatchRequest:
    """The dispatch for one step of `job` (for a flow, the round whose conversation is
    `messages`). A flow whose tools are no longer registered raises UnknownTool or
    ImproperlyConfigured."""
    data = job.input
    if job.type == Job.Type.TRANSLATE:
        data = {
            **{k: v for k, v in data.items() if k not in TRANSLATE_ONLY},
            "messages": translate_messages(
                text=data["text"], target_lang=data["target_lang"], source_lang=data.get("source_lang")
            ),
        }
    elif job.type == Job.Type.FLOW:
        schemas = [tool_resolve(name=name).schema() for name in data.get("tools") or ()]
        data = {
            **{k: v for k, v in data.items() if k not in FLOW_ONLY},
            "messages": messages if messages is not None else data.get("messages") or [],
            **({"tools": schemas} if schemas else {}),
        }
    return DispatchRequest(job_id=job.pk, type=job.type, model=job.model, input=data, requirements=job.requirements)


def job_output(job: Job, output: dict[str, Any]) -> dict[str, Any]:
    """The job's result from the driver's output: a translation keeps the text alone (and the
    model, and the simulator's label when simulated)."""
    if job.type != Job.Type.TRANSLATE:
        return output
    text = (output.get("message") or {}).get("content") or ""
    return {"text": text, "model": output.get("model"), **({"simulated": True} if output.get("simulated") else {})}


def job_input_check(*, type: str, input: dict[str, Any], team: Team, require: Callable[[str], None]) -> None:
    """At submit, after the job type's own permission: every tool a flow names exists and the
    principal may invoke tools in the team (`require(permission)` raises Forbidden when not: the
    submit's cached grants answer it); a tool job's tool exists and its arguments fit the tool's
    schema. Raises ValidationFailed (400) naming the tool or the permission."""
    if type == Job.Type.FLOW and input.get("tools"):
        for name in input["tools"]:
            _resolve(name, field="tools")
        try:
            require(rbac.TOOLS)
        except Forbidden:
            raise ValidationFailed(
                {
                    "input": {
                        "tools": [f"Calling tools needs {rbac.TOOLS} in team {team.slug!r}, which you do not have."]
                    }
                }
            ) from None
    elif type == Job.Type.TOOL:
        found = _resolve(input["tool"], field="tool")
        try:
            tool_arguments_check(found, input.get("arguments", {}))
        except ToolError as exc:
            raise ValidationFailed({"input": {"arguments": [str(exc)]}}) from None


def _resolve(name: str, *, field: str) -> Tool:
    try:
        return tool_resolve(name=name)
    except (UnknownTool, ImproperlyConfigured) as exc:
        raise ValidationFailed({"input": {field: [str(exc)]}}) from None
