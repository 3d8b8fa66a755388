"""Money: a job's estimate before it runs, and an attempt's cost after (tokens x the executor's
prices, executors/prices.py), both Decimal.

The estimate splits the job's tokens the way prices do. Prompt tokens are counted from the input
at submit (the same stand-in tokenizer the drivers fall back on); completion tokens are the
request's max_tokens (a model server never writes more), or, without one, what `est_tokens`
leaves after the prompt. Against `ai.cost` budgets the claim reserves that split priced on the
executor it places the job on, and admission checks it on the dearest executor that could take
it, so billed cost overshoots a budget only by what an attempt uses beyond its estimate: a prompt
the server counts as longer, or a completion past `est_tokens` when there is no max_tokens."""

from collections.abc import Iterable
from decimal import Decimal
from typing import Any

from executors.contract import EMBEDDINGS_API
from executors.models import Executor
from executors.prices import ZERO, dearest, price_of
from executors.tokens import count_prompt_tokens, embedding_inputs
from scheduler.models import Job


def token_split_estimate(
    *, type: str, requirements: dict[str, Any], input: dict[str, Any], estimate: int
) -> tuple[int, int]:
    """(prompt, completion) tokens a job's attempt is expected to use, for pricing."""
    if requirements.get("api") == EMBEDDINGS_API:
        return sum(len(text.split()) for text in embedding_inputs(input.get("input"))), 0
    messages = input.get("messages")
    if type == Job.Type.TRANSLATE:
        prompt = 30 + len(str(input.get("text") or "").split())
    elif isinstance(messages, list):
        prompt = count_prompt_tokens([m for m in messages if isinstance(m, dict)])
    else:
        prompt = 0
    limit = input.get("max_tokens") or input.get("max_completion_tokens")
    completion = (
        int(limit)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
        else max(estimate - prompt, 0)
    )
    return prompt, completion


def job_money_estimate(job: Job, executors: Iterable[Executor]) -> Decimal:
    """The most one attempt of the job is expected to cost on any of `executors` (one executor:
    on that one)."""
    return dearest(
        executors,
        job.model,
        prompt_tokens=job.est_prompt_tokens,
        completion_tokens=job.est_completion_tokens,
        batch=job.batch_id is not None,
    )


def attempt_price(
    executor: Executor | None,
    model: str,
    *,
    tokens: int,
    prompt_tokens: int | None,
    completion_tokens: int | None,
    batch: bool = False,
) -> tuple[Decimal, int, int]:
    """What an attempt cost, and its prompt and completion tokens: priced from the split the
    executor reported; tokens without a split are priced as completion (the dearer side, as a rule).
    A batch's line (`batch`) pays the model's batch price where it has one."""
    prompt = prompt_tokens or 0
    completion = completion_tokens or 0
    if prompt + completion < tokens:
        completion += tokens - prompt - completion
    if tokens <= 0 and prompt + completion <= 0:
        return ZERO, 0, 0
    cost = price_of(executor, model, prompt_tokens=prompt, completion_tokens=completion, batch=batch)
    return cost, prompt, completion
