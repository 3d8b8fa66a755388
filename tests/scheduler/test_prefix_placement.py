"""Prefix-cache-aware placement (QueuePolicy.placement = prefix, issue #39): the prompt's chained
block hashes, the bounded record per executor, the load bound on recent work; then, on PostgreSQL with real
model servers and two real workers, jobs sharing a prefix land on one executor, and a hot prefix
spreads when it would pile onto it."""

import time
from collections import Counter

import pytest
from django.db import connection
from django.test import override_settings

from executors.models import Executor
from scheduler.core.prefix import RECORD, PrefixRecord, load_limit, prefix_place, prompt_prefix
from scheduler.core.state import ExecutorView
from scheduler.models import Job
from scheduler.services.claim import job_claim
from scheduler.services.policy import queue_policy_update
from scheduler.services.submit import job_submit
from tests.processes import wait_until

SYSTEM = "You are a careful assistant for the Telemachus platform team. " * 20  # ~1,300 characters


def messages(question: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


class TestHashes:
    def test_prompts_sharing_a_prefix_share_its_leading_hashes(self):
        one, two = prompt_prefix({"messages": messages("first?")}), prompt_prefix({"messages": messages("second?")})
        assert one and two and len(one) >= 4
        shared = len(SYSTEM) // 256
        assert one[: shared - 1] == two[: shared - 1]
        other = prompt_prefix({"messages": messages("first?", system="Another system prompt entirely. " * 40)})
        assert other and other[0] != one[0], "a different first block differs from the first hash on"

    def test_a_short_prompt_has_no_prefix(self):
        assert prompt_prefix({"messages": [{"role": "user", "content": "hi"}]}) is None
        assert prompt_prefix({"input": "no messages"}) is None

    @override_settings(TELEMACHUS_PREFIX_MAX_BLOCKS=3)
    def test_the_blocks_hashed_are_bounded(self):
        assert len(prompt_prefix({"messages": messages("q")}) or []) == 3

    @override_settings(TELEMACHUS_PREFIX_RECORD_SIZE=4)
    def test_the_record_per_executor_is_bounded(self):
        record = PrefixRecord()
        record.placed(1, ["a", "b", "c"])
        record.placed(1, ["d", "e"])
        assert record.matched(1, ["a"]) == 0, "the least recently placed went first"
        assert record.matched(1, ["x", "c", "d", "e"]) == 4, "the longest recorded hash says the rest match"
        assert record.matched(2, ["c"]) == 0


def views(*in_use: int, limit: int = 4) -> list[ExecutorView]:
    return [
        ExecutorView(executor=Executor(pk=i + 1, name=f"e{i + 1}"), limit=limit, in_use=used)
        for i, used in enumerate(in_use)
    ]


class TestPlace:
    def setup_method(self):
        RECORD.forget()

    def test_one_prefix_goes_home_while_its_share_of_recent_work_is_within_the_bound(self):
        job = Job(prefix=prompt_prefix({"messages": messages("q")}), prefix_home=1)
        cluster = views(3, 0)
        chosen = prefix_place(job, cluster, cluster, {1: 10, 2: 7})
        assert chosen.pk == 1, "3 of 4 slots in use, yet 11 <= 1.4 x 7 + 2: home"
        chosen = prefix_place(job, cluster, cluster, {1: 10, 2: 6})
        assert chosen.pk == 2, "11 > 1.4 x 6 + 2: it spills"

    def test_a_new_prefix_goes_where_its_first_block_ranks_it_in_every_process(self):
        job = Job(prefix=prompt_prefix({"messages": messages("q")}))
        chosen = prefix_place(job, views(0, 0, 0), views(0, 0, 0), {})
        RECORD.forget()  # another process, with a record of its own
        assert prefix_place(job, views(0, 0, 0), views(0, 0, 0), {}).pk == chosen.pk

    def test_a_new_prefix_goes_to_the_least_busy(self):
        job = Job(prefix=prompt_prefix({"messages": messages("q")}))
        assert prefix_place(job, views(0, 0, 0), views(0, 0, 0), {1: 9, 2: 8, 3: 7}).pk == 3

    def test_the_home_every_process_shares_wins_within_the_bound(self):
        prefix = prompt_prefix({"messages": messages("q")})
        assert prefix_place(Job(prefix=prefix, prefix_home=3), views(0, 0, 0), views(0, 0, 0), {}).pk == 3
        chosen = prefix_place(Job(prefix=prefix, prefix_home=3), views(0, 0, 0), views(0, 0, 0), {3: 2})
        assert chosen.pk != 3, "3 > 1.4 x 0 + 2: past the bound, it spills"

    def test_a_spill_goes_to_the_least_busy_within_the_bound(self):
        # A hot prefix's overflow would push a second executor's own prefixes off it.
        prefix = prompt_prefix({"messages": messages("q")})
        chosen = prefix_place(Job(prefix=prefix, prefix_home=1), views(0, 0, 0), views(0, 0, 0), {1: 30, 2: 25, 3: 20})
        assert chosen.pk == 3

    def test_when_the_least_busy_are_full_the_least_busy_with_a_free_slot_takes_it(self):
        prefix = prompt_prefix({"messages": messages("q")})
        serving = views(0, 1, 4)
        chosen = prefix_place(Job(prefix=prefix, prefix_home=1), serving[:2], serving, {1: 30, 2: 25, 3: 10})
        assert chosen.pk == 2, "the bound (1.4 x 10 + 2) leaves only the full executor 3"

    def test_an_executor_on_a_breaker_trial_does_not_hold_the_others_down(self):
        prefix = prompt_prefix({"messages": messages("q")})
        serving = views(0, 0, 0)
        serving[2].trial = True
        chosen = prefix_place(Job(prefix=prefix, prefix_home=1), serving, serving, {1: 30, 2: 25, 3: 1})
        assert chosen.pk == 1, "31 <= 1.4 x 25 + 2: the trial's one placement is not the least busy"

    def test_the_bound(self):
        assert load_limit(views(0, 0), {}) == 2
        assert load_limit(views(0, 0, 0), {1: 10, 2: 20, 3: 30}) == pytest.approx(16)
        assert load_limit(views(0, 0), {1: 10}) == 2, "an executor with no recent work counts 0"

    def test_a_job_without_a_prefix_is_left_to_the_rule(self):
        assert prefix_place(Job(prefix=None), views(0, 0), views(0, 0), {}) is None


@pytest.mark.django_db
class TestClaim:
    def test_a_home_is_bounded_by_the_work_every_process_placed_on_it(self, member_setup, make_executor):
        # Given prefix placement, and ten calls of one prefix that ran on `home` while four other
        # calls ran on `other` (as any process placed them: the claim reads the jobs).
        alice, _, _, _, home = member_setup
        other = make_executor("other", models=["m"])
        queue_policy_update(changes={"placement": "prefix"}, by=None)
        RECORD.forget()

        def submit(question: str, system: str = SYSTEM) -> Job:
            return job_submit(
                user=alice,
                team="a",
                type="chat",
                requirements={"model": "m"},
                input={"messages": messages(question, system)},
            )

        def ran(executor: Executor, jobs: list[Job]) -> None:
            Job.objects.filter(pk__in=[j.pk for j in jobs]).update(executor=executor, status="done")

        ran(home, [submit(f"q{i}") for i in range(10)])
        ran(other, [submit("hi", system="") for _ in range(4)])
        # When the next call of the prefix is claimed, then its home is past the bound
        # (11 > 1.4 x 4 + 2), though its slots are all free: it goes to the other executor.
        spilled = submit("next")
        assert spilled.prefix_home == home.pk
        job_claim(worker="t")
        assert Job.objects.get(pk=spilled.pk).executor_id == other.pk
        # When the other has had its share too (8), the next goes home (11 <= 1.4 x 8 + 2).
        ran(other, [submit("hi", system="") for _ in range(3)])
        homed = submit("after")
        job_claim(worker="t")
        assert Job.objects.get(pk=homed.pk).executor_id == home.pk


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
class TestWithServersAndWorkers:
    """Two simllm servers, an executor on each (4 slots), two workers, placement prefix."""

    @pytest.fixture
    def cluster(self, processes, member_setup, make_executor):
        if connection.vendor != "postgresql":
            pytest.skip("needs PostgreSQL (set DATABASE_URL=postgres://...): two workers share the claim")
        alice, _, _, _, shared = member_setup
        shared.delete()
        executors = [
            Executor.objects.create(
                name=f"s{i}",
                kind="local-model",
                endpoint=f"{processes.simllm(latency_ms=300, models='m')}/v1",
                capabilities={"models": ["m"]},
                max_concurrency=4,
            )
            for i in range(2)
        ]
        queue_policy_update(changes={"placement": "prefix"}, by=None)
        for name in ("w1", "w2"):
            worker = processes.worker(name, concurrency=8)
        wait_until(lambda: "starting" in worker.log_path.read_text(), timeout=30, what="the workers to start")
        return alice, executors

    def run(self, alice, prompts: list[list[dict]]) -> list[Job]:
        jobs = [
            job_submit(user=alice, team="a", type="chat", requirements={"model": "m"}, input={"messages": p})
            for p in prompts
        ]
        ids = [job.pk for job in jobs]
        wait_until(
            lambda: Job.objects.filter(pk__in=ids, status="done").count() == len(ids), timeout=60, what="the jobs"
        )
        return list(Job.objects.filter(pk__in=ids))

    def test_shared_prefix_jobs_land_on_one_executor_and_a_hot_one_spreads(self, cluster):
        alice, executors = cluster
        # One after another, two prefixes: each keeps to one executor.
        landed: dict[str, Counter[int]] = {"A": Counter(), "B": Counter()}
        other = "You translate technical documents into plain English for operators. " * 20
        for i in range(6):
            for name, system in (("A", SYSTEM), ("B", other)):
                (job,) = self.run(alice, [messages(f"question {i}", system=system)])
                landed[name][job.executor_id] += 1
        assert all(len(counts) == 1 for counts in landed.values()), landed

        # A burst of one hot prefix, more than one executor's share: it spreads within the bound.
        started = time.monotonic()
        burst = self.run(alice, [messages(f"burst {i}") for i in range(8)])
        split = Counter(job.executor_id for job in burst)
        assert len(split) == 2 and max(split.values()) <= 1.5 * min(split.values()), split
        assert time.monotonic() - started < 10
