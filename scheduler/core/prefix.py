"""Prefix-cache-aware placement (QueuePolicy.placement = "prefix", issue #39), after llm-d's
approximate prefix scorer.

A model server keeps the KV cache of prompts it served recently; a request that starts with the
same tokens (a long system prompt, a tool list, a document) skips recomputing them, which cuts its
time to first token several-fold. So jobs whose prompts share a prefix should go to the executor
that served it, but not all of them: a hot prefix on one server would leave the others idle.

* At submit, the prompt (its messages as the model server reads them) is cut into blocks of
  TELEMACHUS_PREFIX_BLOCK_CHARS characters, and each block hashed together with the hash of the
  blocks before it (`prompt_prefix`): two prompts share their first n hashes exactly when they
  share their first n blocks. The job keeps up to TELEMACHUS_PREFIX_MAX_BLOCKS of them
  (`Job.prefix`), so the claim, which does not read prompts, can place it.
* Each process keeps, per executor, a bounded record of the hashes it placed there recently
  (least recently placed dropped first, TELEMACHUS_PREFIX_RECORD_SIZE per executor); and every
  process shares where a prefix went last through the jobs themselves: at submit a job learns the
  executor of the last placed job with the same first block (`Job.prefix_home`, one indexed
  query), so workers on many hosts agree where a prefix lives.
* The placement (`prefix_place`) keeps every executor's share of recent work within a load bound:
  an executor takes the job only if its count among the last PREFIX_WORK_WINDOW placed jobs, with
  this one, stays within TELEMACHUS_PREFIX_LOAD_FACTOR times the least busy serving executor's,
  plus PREFIX_LOAD_SLACK (consistent hashing with bounded loads). The count is what every process
  placed, read from the jobs, not the slots in use at this instant: slots in use swing with every
  call's arrival, so a bound on them sent a quarter of the calls away from home while the share of
  work stayed even. Among the executors within the bound: the prefix's home; when the home is past
  the bound, the least busy (then rendezvous order), not the prefix's next rendezvous choice,
  which would pile a hot prefix's overflow onto one second executor and push that executor's own
  prefixes off it; a prefix with no home yet goes to the longest match in this process's record,
  then to the least busy, then to the least loaded now, then to the executor its first block's
  hash ranks first (rendezvous hashing). When none with a free slot is within the bound (the
  least busy are full), the least busy with a free slot.

Round affinity (a flow's next round on the executor of its last) is decided before this
(BaseQueuePolicy.place), and fair share decides the order, never the placement."""

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from django.conf import settings

if TYPE_CHECKING:
    from scheduler.core.state import ExecutorView
    from scheduler.models import Job


def prompt_prefix(input: dict[str, Any]) -> list[str] | None:
    """The chained hashes of the prompt's blocks (at most TELEMACHUS_PREFIX_MAX_BLOCKS); None when
    the job has no messages or its prompt is shorter than one block. Each is 16 hex digits of
    BLAKE2b over the previous hash and the block."""
    messages = input.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    text = "".join(
        json.dumps([m.get("role"), m.get("content")], ensure_ascii=False, separators=(",", ":"))
        for m in messages
        if isinstance(m, dict)
    )
    size = settings.TELEMACHUS_PREFIX_BLOCK_CHARS
    blocks = min(len(text) // size, settings.TELEMACHUS_PREFIX_MAX_BLOCKS)
    hashes: list[str] = []
    previous = b""
    for i in range(blocks):
        digest = hashlib.blake2b(previous + text[i * size : (i + 1) * size].encode(), digest_size=8).digest()
        hashes.append(digest.hex())
        previous = digest
    return hashes or None


class PrefixRecord:
    """Per executor, the prefix hashes this process placed there recently, bounded (least recently
    placed dropped first). Shared by the process's claims (its claim thread, a worker's loop):
    guarded by a lock held only for dictionary work."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[int, OrderedDict[str, None]] = {}

    def matched(self, executor_id: int, prefix: Sequence[str]) -> int:
        """How many of the prefix's leading blocks the executor served recently (chained hashes:
        the longest recorded one says the blocks before it match too)."""
        with self._lock:
            seen = self._seen.get(executor_id)
            if not seen:
                return 0
            return next((i + 1 for i in range(len(prefix) - 1, -1, -1) if prefix[i] in seen), 0)

    def placed(self, executor_id: int, prefix: Sequence[str]) -> None:
        with self._lock:
            seen = self._seen.setdefault(executor_id, OrderedDict())
            for value in prefix:
                seen[value] = None
                seen.move_to_end(value)
            while len(seen) > settings.TELEMACHUS_PREFIX_RECORD_SIZE:
                seen.popitem(last=False)

    def forget(self) -> None:
        with self._lock:
            self._seen.clear()


RECORD = PrefixRecord()

# The placed jobs the load bound counts (the newest, every process's): at 30 calls a second, the
# last ten seconds.
PREFIX_WORK_WINDOW = 300
# Placements an executor may have above the load factor times the least busy one's.
PREFIX_LOAD_SLACK = 2


def load_limit(serving: Sequence["ExecutorView"], work: Mapping[int, int]) -> float:
    """The most recent placements one executor may have with the job placed there: the load
    factor times the least busy serving executor's, plus PREFIX_LOAD_SLACK (so the first calls of
    a quiet cluster are not refused everywhere). An executor new to the work takes the prefixes'
    spills until its count catches up, as a free slot allows."""
    least = min((work.get(v.pk, 0) for v in serving), default=0)
    return settings.TELEMACHUS_PREFIX_LOAD_FACTOR * least + PREFIX_LOAD_SLACK


def _rank(first: str, executor_id: int) -> bytes:
    return hashlib.blake2b(f"{first}:{executor_id}".encode(), digest_size=8).digest()


def prefix_place(
    job: "Job", candidates: list["ExecutorView"], serving: Sequence["ExecutorView"], work: Mapping[int, int]
) -> "ExecutorView | None":
    """The candidate for a job with a prompt prefix (None: it has none, so the caller places it
    least-loaded). `candidates` have a free slot; `serving` are every placeable executor that
    could take the job, full or not, for the load bound; `work` counts each executor's recent
    placements (ClaimState.recent_work). Records the choice in this process's record."""
    prefix = job.prefix
    if not prefix or not candidates:
        return None
    # An executor on a breaker trial takes one call at a time: its few placements would hold every
    # other executor to almost none.
    limit = load_limit([v for v in serving if not v.trial] or serving or candidates, work)
    within = [v for v in candidates if work.get(v.pk, 0) + 1 <= limit]
    home = next((v for v in within if v.pk == job.prefix_home), None)
    if home is not None:
        chosen = home
    elif within and job.prefix_home is None:
        chosen = max(
            within,
            key=lambda v: (RECORD.matched(v.pk, prefix), -work.get(v.pk, 0), -v.load, _rank(prefix[0], v.pk)),
        )
    else:  # its home is past the bound, or every candidate is
        chosen = max(within or candidates, key=lambda v: (-work.get(v.pk, 0), _rank(prefix[0], v.pk)))
    RECORD.placed(chosen.pk, prefix)
    return chosen
