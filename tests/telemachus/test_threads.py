"""The gateway's thread pool: the warmest thread first, every thread under load, nothing lost."""

import asyncio
import threading

import pytest

from telemachus.threads import WarmestFirst


@pytest.fixture
def pool():
    threads = WarmestFirst(4, name="test-pool")
    yield threads
    threads.shutdown()


def test_calls_one_after_another_run_on_one_thread(pool):
    # Given four threads started by a burst (each holds until all four run)...
    barrier = threading.Barrier(4)
    burst = [pool.submit(lambda: (barrier.wait(5), threading.current_thread().name)[1]) for _ in range(4)]
    assert len({f.result(5) for f in burst}) == 4

    # When calls come one after another, each sent as soon as the last one's caller hears...
    names = [pool.submit(lambda: threading.current_thread().name).result(5) for _ in range(50)]

    # Then one thread serves them all: the one that went idle last.
    assert len(set(names)) == 1


def test_the_last_idle_thread_takes_the_next_call(pool):
    first = threading.Event()
    second = threading.Event()
    a = pool.submit(lambda: (first.wait(5), threading.current_thread().name)[1])
    b = pool.submit(lambda: (second.wait(5), threading.current_thread().name)[1])
    second.set()
    b_name = b.result(5)
    first.set()
    a_name = a.result(5)
    assert a_name != b_name
    # Both went back in line before their callers heard, `a`'s thread last.
    assert pool.submit(lambda: threading.current_thread().name).result(5) == a_name


def test_work_beyond_the_threads_waits_its_turn_and_runs(pool):
    gate = threading.Event()
    started = threading.Semaphore(0)

    def held(n: int) -> int:
        started.release()
        gate.wait(5)
        return n

    futures = [pool.submit(held, n) for n in range(10)]
    for _ in range(4):
        assert started.acquire(timeout=5)
    assert not started.acquire(timeout=0.1)  # four threads at most: the rest wait
    gate.set()
    assert [f.result(5) for f in futures] == list(range(10))
    assert sum(t.name.startswith("test-pool_") for t in threading.enumerate()) <= 4


def test_an_exception_reaches_the_caller_and_the_thread_serves_on(pool):
    def fails() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        pool.submit(fails).result(5)
    assert pool.submit(lambda: 42).result(5) == 42


def test_a_canceled_waiting_call_never_runs(pool):
    gate = threading.Event()
    ran = []
    busy = [pool.submit(gate.wait, 5) for _ in range(4)]
    late = pool.submit(ran.append, 1)
    assert late.cancel()
    gate.set()
    for f in busy:
        f.result(5)
    assert pool.submit(lambda: 7).result(5) == 7
    assert ran == []


def test_shutdown_finishes_what_was_sent_then_refuses():
    pool = WarmestFirst(2, name="test-pool-down")
    gate = threading.Event()
    futures = [pool.submit(lambda n=n: (gate.wait(5), n)[1]) for n in range(5)]
    threading.Timer(0.1, gate.set).start()
    pool.shutdown(wait=True)
    assert [f.result(0) for f in futures] == list(range(5))
    assert not [t for t in threading.enumerate() if t.name.startswith("test-pool-down")]
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)


def test_shutdown_can_cancel_what_waits():
    pool = WarmestFirst(1, name="test-pool-cancel")
    gate = threading.Event()
    running = pool.submit(gate.wait, 5)
    waiting = pool.submit(lambda: "ran")
    threading.Timer(0.1, gate.set).start()
    pool.shutdown(wait=True, cancel_futures=True)
    assert running.result(0) is True
    assert waiting.cancelled()


def test_an_event_loop_runs_its_calls_on_it(pool):
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        return [await loop.run_in_executor(pool, lambda: threading.current_thread().name) for _ in range(5)]

    names = asyncio.run(main())
    assert len(set(names)) == 1 and names[0].startswith("test-pool")


def test_at_least_one_thread():
    with pytest.raises(ValueError):
        WarmestFirst(0, name="none")
