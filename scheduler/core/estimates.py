"""What a job is expected to use, in tokens: the estimate its budgets are checked against at
submit and reserved at each claim (quotas/budget.py).

A submitter may say (`requirements.est_tokens`). One that does not gets a real estimate, never 0,
or a job without one would pass every budget and be billed only after it ran: its prompt's tokens
(executors/tokens.py counts them as the simulator and the drivers do when a server reports no
usage) plus the completion it may write, `max_tokens` (or `max_completion_tokens`) when the input
sets it, else the model's expected completion (TELEMACHUS_COMPLETION_ESTIMATES per model, else
TELEMACHUS_COMPLETION_ESTIMATE). A flow is estimated per round, on the conversation so far: its
next round's prompt holds every earlier round. Jobs that call no model (task, tool) use no tokens.
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
    """The tokens a job (a flow: its first round) is expected to use, as submitted."""
    given = given_estimate(requirements)
    if given is not None:
        return given
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
    """A flow's next round: its given estimate (per round), else the conversation so far (the
    input's messages and every earlier round's) plus the completion it may write."""
    given = given_estimate(job.requirements)
    if given is not None:
        return given
    messages = [m for m in [*(job.input.get("messages") or ()), *job.conversation] if isinstance(m, dict)]
    return count_prompt_tokens(messages) + completion_estimate(model=job.model, max_tokens=input_max_tokens(job.input))
