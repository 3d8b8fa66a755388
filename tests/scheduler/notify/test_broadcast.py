"""NOTIFY payloads stay under PostgreSQL's limit, however much they carry."""

import json

from scheduler.notify import broadcast
from telemachus.control import notify as signals
from telemachus.db.notify import chunked_payloads


def test_job_changes_split_into_payloads_under_the_limit():
    items = [f"{job_id}:finished" for job_id in range(100_000, 101_000)]
    payloads = chunked_payloads(signals.CHANGED, items)
    assert len(payloads) > 1 and all(len(p.encode()) < 8000 for p in payloads)
    assert [i for p in payloads for i in p.removeprefix(signals.CHANGED).split(",")] == items


def test_a_long_delta_splits_into_pieces_that_carry_their_offsets():
    text = "word " * 3000 + "\u00e9\U0001f600" * 1000
    message = broadcast.delta_message(job_id=7, attempt=2, offset=100, text=text)
    payloads = broadcast._delta_payloads(message)
    assert len(payloads) > 1 and all(len(p.encode()) < 8000 for p in payloads)
    pieces = [json.loads(p.removeprefix(signals.DELTA)) for p in payloads]
    assert "".join(piece["text"] for piece in pieces) == text
    assert [piece["offset"] for piece in pieces] == [
        100 + sum(len(p["text"]) for p in pieces[:i]) for i in range(len(pieces))
    ]
    assert {(piece["job"], piece["attempt"]) for piece in pieces} == {(7, 2)}
