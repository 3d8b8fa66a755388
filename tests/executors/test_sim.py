"""The in-process `sim` executor: knobs from the executor's meta, labelled results."""

import asyncio

import pytest

from executors.contract import DispatchError, DispatchRequest
from executors.drivers.sim import SimDriver
from executors.models import Executor


def dispatch(**meta):
    executor = Executor(name="s", kind="sim", capabilities={"models": ["m"]}, meta={"latency_ms": 0, **meta})
    request = DispatchRequest(
        job_id=1, type="chat", model="m", input={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    )
    return asyncio.run(SimDriver(executor).dispatch(request))


def test_result_is_labelled_and_counts_tokens():
    result = dispatch(output_tokens=10)
    assert result.output["simulated"] is True
    assert result.output["message"]["content"] == "[simulated reply from s] hi"
    assert result.completion_tokens == 3 and result.output["finish_reason"] == "length"


def test_fail_rate_one_always_fails_and_zero_never_does():
    with pytest.raises(DispatchError, match="simulated failure") as caught:
        dispatch(fail_rate=1)
    assert caught.value.retryable is False
    assert all(dispatch(fail_rate=0).output["simulated"] for _ in range(20))


def test_bad_knob_values_fall_back_to_defaults():
    assert dispatch(fail_rate="often", output_tokens=None).completion_tokens == 3


@pytest.mark.parametrize(
    "meta",
    [
        {"latency_ms": 1e12},
        {"latency_ms": float("inf")},
        {"jitter_ms": 1e15},
        {"tokens_per_s": 1e-12, "output_tokens": 3},
        {"output_tokens": float("nan")},
        {"output_tokens": 1e30},
        {"latency_ms": -5},
        {"fail_rate": "abc"},
    ],
)
def test_stored_nonsense_neither_hangs_nor_crashes_the_driver(meta, monkeypatch):
    """Values stored before the API's checks (or by SQL) are clamped or read as the default: the
    dispatch still ends, and soon (10 minutes at most, here shortened by scaling the clock)."""
    slept = []

    async def sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    result = dispatch(**meta)
    assert result.output["simulated"] is True and 0 <= result.completion_tokens <= 3
    assert all(0 <= s <= 600 for s in slept), slept


def test_embedding_dims_are_bounded():
    executor = Executor(
        name="s",
        kind="sim",
        capabilities={"models": ["m"], "embeddings": True},
        meta={"latency_ms": 0, "embedding_dims": 10**9},
    )
    request = DispatchRequest(
        job_id=1, type="chat", model="m", input={"input": "hi"}, requirements={"api": "embeddings"}
    )
    assert len(asyncio.run(SimDriver(executor).dispatch(request)).output["data"][0]["embedding"]) == 4096
