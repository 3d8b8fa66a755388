"""What a job is expected to use, in tokens: the estimate its budgets are checked against at
submit and reserved at each claim (quotas/budget.py).

Every model call is estimated at what its request can cost: its prompt's tokens (executors/tokens.py
counts them as the simulator and the drivers do when a server reports no usage) plus the
completion it may write, `max_tokens` (or `max_completion_tokens`) when the input sets it, else
the model's expected completion (TELEMACHUS_COMPLETION_ESTIMATES per model, else
TELEMACHUS_COMPLETION_ESTIMATE). A submitter may say more (`requirements.est_tokens`), never less:
an estimate of 0 taken as given reserved nothing, so every free slot ran against an empty budget
(a hostile probe billed 80 times a 100-token budget that way). A flow is estimated per round, on
the conversation so far: its next round's prompt holds every earlier round. Jobs that call no model
(task, tool) use no tokens unless their submitter says they do.
"""

from typing import Any

from django.conf import settings

from executors.contract import EMBEDDINGS_API
from executors.tokens import count_prompt_tokens, embedding_inputs
from scheduler.core.jobtypes import translate_messages
from scheduler.models import Job

# Job types that make no model call, so spend no tokens.
NO_MODEL_CALL = frozenset({Job.Type.TASK, Job.Type.TOOL})


def completion_estimate(*, model: str, max_tokens: int | None = None) -> int:
    """The completion tokens a model call may use: `max_tokens` when the caller bounds it, else
    the model's expected completion (a setting)."""
    if max_tokens is not None:
        return max_tokens
    return int(settings.TELEMACHUS_COMPLETION_ESTIMATES.get(model, settings.TELEMACHUS_COMPLETION_ESTIMATE))


def input_max_tokens(data: dict[str, Any]) -> int | None:
    """The completion bound a job's input sets, if it sets one (OpenAI's two names for it)."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = data.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def given_estimate(requirements: dict[str, Any]) -> int | None:
    """The submitter's own estimate, if it gave one."""
    value = requirements.get("est_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def job_estimate(*, type: str, model: str, requirements: dict[str, Any], input: dict[str, Any]) -> int:
    """The tokens a job (a flow: its first round) is expected to use, as submitted: what its
    request can cost, or the submitter's estimate when that is higher. A governed slot's model
    call is its app's own, unseen here: its app's estimate stands (else the model's expected
    completion)."""
    given = given_estimate(requirements)
    if type == Job.Type.GOVERNED and given is not None:
        return given
    return _at_least_given(
        requirements, _request_estimate(type=type, model=model, requirements=requirements, input=input)
    )


def _request_estimate(*, type: str, model: str, requirements: dict[str, Any], input: dict[str, Any]) -> int:
    if type in NO_MODEL_CALL:
        return 0
    if requirements.get("api") == EMBEDDINGS_API:
        return sum(len(text.split()) for text in embedding_inputs(input.get("input")))
    if type == Job.Type.TRANSLATE:
        messages = translate_messages(
            text=str(input.get("text") or ""),
            target_lang=str(input.get("target_lang") or ""),
            source_lang=input.get("source_lang"),
        )
    else:
        messages = [m for m in input.get("messages") or () if isinstance(m, dict)]
    return count_prompt_tokens(messages) + completion_estimate(model=model, max_tokens=input_max_tokens(input))


def round_estimate(job: Job) -> int:
    """A flow's next round: the conversation so far (the input's messages and every earlier
    round's) plus the completion it may write, or the submitter's per-round estimate when higher."""
    messages = [m for m in [*(job.input.get("messages") or ()), *job.conversation] if isinstance(m, dict)]
    request = count_prompt_tokens(messages) + completion_estimate(
        model=job.model, max_tokens=input_max_tokens(job.input)
    )
    return _at_least_given(job.requirements, request)


def _at_least_given(requirements: dict[str, Any], request: int) -> int:
    """The submitter's estimate may raise what a request is expected to cost, never lower it."""
    given = given_estimate(requirements)
    return max(given, request) if given is not None else request
