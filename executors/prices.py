"""What a model costs on an executor: `Executor.prices`, `{"<model>": {"input": "<price per 1M
input tokens>", "output": "<price per 1M output tokens>"}}`, decimal strings in
TELEMACHUS_CURRENCY. A model without a price costs nothing there (a local model, say). A model
may also have a batch price (`batch_input`, `batch_output`), what a batch's line pays instead
(docs/batches.md); a side without one pays the live price.

Arithmetic is Decimal only. Prices have at most 6 decimal places, so a token's price (a millionth
of it) has at most 12, which the ledger keeps exactly: `price_of` is tokens x price, exactly."""

from collections.abc import Iterable
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the model module checks prices with this one
    from executors.models import Executor

PER_TOKENS = Decimal(1_000_000)
PRICE_PLACES = 6
MAX_PRICE = Decimal(1_000_000)
ZERO = Decimal(0)
SIDES = ("input", "output")
BATCH_SIDES = ("batch_input", "batch_output")


def price_problems(prices: Any) -> dict[str, str]:
    """What is wrong with a `prices` value, per model (or "prices" for the whole): empty if valid."""
    if not isinstance(prices, dict):
        return {"prices": "must be an object: {model: {input, output}}"}
    problems: dict[str, str] = {}
    for model, price in prices.items():
        if not isinstance(model, str) or not model or len(model) > 200:
            problems[str(model)[:200]] = "is not a model name"
            continue
        if not isinstance(price, dict) or set(price) - {*SIDES, *BATCH_SIDES} or not set(price) & set(SIDES):
            problems[model] = (
                'must be {"input": "<per 1M tokens>", "output": "<per 1M tokens>"}, '
                'optionally with "batch_input" and "batch_output"'
            )
            continue
        for side, value in price.items():
            amount = _decimal(value)
            if amount is None or not amount.is_finite() or amount < 0 or amount > MAX_PRICE:
                problems[model] = f"{side} must be a decimal string from 0 to {MAX_PRICE}"
            elif -amount.as_tuple().exponent > PRICE_PLACES:  # type: ignore[operator]
                problems[model] = f"{side} has more than {PRICE_PLACES} decimal places"
    return problems


def prices_stored(prices: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Valid prices as stored: each side a plain decimal string (numbers given as JSON numbers
    are kept as the text they were written as)."""
    return {
        model: {side: format(_decimal(value) or ZERO, "f") for side, value in price.items()}
        for model, price in prices.items()
    }


def model_price(executor: "Executor", model: str, *, batch: bool = False) -> tuple[Decimal, Decimal] | None:
    """(input, output) per 1M tokens of the model on this executor, for a batch's line with
    `batch` (its batch price, side by side, where it has one); None when it has no price."""
    price = (executor.prices or {}).get(model) if isinstance(executor.prices, dict) else None
    if not isinstance(price, dict):
        return None
    live = _decimal(price.get("input")) or ZERO, _decimal(price.get("output")) or ZERO
    if not batch:
        return live
    batch_input, batch_output = _decimal(price.get("batch_input")), _decimal(price.get("batch_output"))
    return (
        batch_input if batch_input is not None else live[0],
        batch_output if batch_output is not None else live[1],
    )


def price_of(
    executor: "Executor | None", model: str, *, prompt_tokens: int, completion_tokens: int, batch: bool = False
) -> Decimal:
    """What these tokens of the model cost on the executor (0 without a price or an executor); a
    batch's line's with `batch`."""
    price = model_price(executor, model, batch=batch) if executor is not None else None
    if price is None or (prompt_tokens <= 0 and completion_tokens <= 0):
        return ZERO
    per_input, per_output = price
    return (per_input * max(prompt_tokens, 0) + per_output * max(completion_tokens, 0)) / PER_TOKENS


def dearest(
    executors: Iterable["Executor"], model: str, *, prompt_tokens: int, completion_tokens: int, batch: bool = False
) -> Decimal:
    """The most these tokens could cost on any of the executors: what admission reserves against
    money budgets before the executor is chosen."""
    return max(
        (
            price_of(e, model, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, batch=batch)
            for e in executors
        ),
        default=ZERO,
    )


def _decimal(value: Any) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, (str, int, float, Decimal)):
        return None
    try:
        return Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        return None
