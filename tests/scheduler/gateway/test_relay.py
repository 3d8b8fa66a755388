"""What a request relays of a job's output (scheduler/gateway/relay.py): a reply's text in order and
once, completed from the result after a gap, broken by a retry once text went out (Relay); and a
streamed flow's job stream (RoundRelay): a round's pieces in order and once, a later attempt of a
round (a retry, or the round run again after its worker died) starting that round over, what was
missed completed from the round's recorded answer, and the cursor a reconnecting client resumes
from."""

from scheduler.gateway.relay import Relay, RoundRelay
from scheduler.notify.feed import Delta


def text(round_no: int, offset: int, piece: str, *, attempt: int = 1) -> Delta:
    return Delta(attempt, offset, piece, round=round_no)


def tool(round_no: int, offset: int, piece: str, *, attempt: int = 1, index: int = 0) -> Delta:
    return Delta(attempt, offset, piece, f"tool:{index}", f"call_{round_no}", "echo", round_no)


def answer(content: str = "", arguments: str | None = None, round_no: int = 1) -> dict:
    calls = (
        [] if arguments is None else [{"id": f"call_{round_no}", "function": {"name": "echo", "arguments": arguments}}]
    )
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


def pieces(sent: list[tuple[Delta, str]]) -> list[tuple[int, int, str, int, str]]:
    return [(d.round, d.attempt, d.part, d.offset, d.text) for d, _ in sent]


def test_a_round_is_relayed_in_order_once_and_closed_with_nothing_more():
    relay = RoundRelay()
    sent = relay.accept([tool(1, 0, '{"a"'), tool(1, 0, '{"a"'), tool(1, 4, ": 1}")], event_id=7)
    assert pieces(sent) == [(1, 1, "tool:0", 0, '{"a"'), (1, 1, "tool:0", 4, ": 1}")]
    assert [cursor for _, cursor in sent] == ["7.1.1.0.4", "7.1.1.0.8"]
    assert relay.close(1, 1, answer(arguments='{"a": 1}'), event_id=7) == []
    assert relay.closed == 1 and relay.cursor(9) == "9"


def test_a_later_round_waits_for_the_open_one_to_close():
    relay = RoundRelay()
    relay.accept([tool(1, 0, '{"a"')], event_id=3)
    assert relay.behind([tool(2, 0, "{")]) and relay.accept([tool(2, 0, "{")], event_id=3) == []
    rest = relay.close(1, 1, answer(arguments='{"a": 1}'), event_id=3)
    assert pieces(rest) == [(1, 1, "tool:0", 4, ": 1}")]
    assert not relay.behind([tool(2, 0, "{")])


def test_a_missed_piece_is_completed_at_the_rounds_end_never_out_of_order():
    relay = RoundRelay()
    assert pieces(relay.accept([text(1, 0, "Hel"), text(1, 5, " wor")], event_id=1)) == [(1, 1, "", 0, "Hel")]
    assert relay.accept([text(1, 9, "ld")], event_id=1) == []
    assert pieces(relay.close(1, 1, answer("Hello world"), event_id=1)) == [(1, 1, "", 3, "lo world")]


def test_a_later_attempt_of_a_round_starts_it_over_and_an_earlier_ones_pieces_are_dropped():
    relay = RoundRelay(closed=1)
    relay.accept([tool(2, 0, '{"x"', attempt=1)], event_id=5)
    again = relay.accept([tool(2, 0, '{"y"', attempt=2), tool(2, 4, ": 1}", attempt=1)], event_id=5)
    assert pieces(again) == [(2, 2, "tool:0", 0, '{"y"')]
    assert pieces(relay.close(2, 2, answer(arguments='{"y": 2}', round_no=2), event_id=5)) == [
        (2, 2, "tool:0", 4, ": 2}")
    ]


def test_a_recovered_round_whose_attempt_the_relay_did_not_follow_comes_whole_under_that_attempt():
    relay = RoundRelay()
    relay.accept([text(1, 0, "first try")], event_id=2)
    rest = relay.close(1, 2, answer("second", arguments="{}"), event_id=2)
    assert pieces(rest) == [(1, 2, "", 0, "second"), (1, 2, "tool:0", 0, "{}")]


def test_a_cursor_resumes_where_the_client_was():
    relay = RoundRelay(closed=2)
    _, cursor = relay.accept([text(3, 0, "ab"), tool(3, 0, "{", index=1)], event_id=40)[-1]
    assert cursor == "40.3.1.2.0.1"
    after, resumed = RoundRelay.resume(cursor)
    assert after == 40 and resumed is not None and resumed.closed == 2
    assert pieces(resumed.accept([text(3, 0, "abc"), tool(3, 0, "{}", index=1)], event_id=40)) == [
        (3, 1, "", 2, "c"),
        (3, 1, "tool:1", 1, "}"),
    ]
    assert RoundRelay.resume("40") == (40, None)


class TestRelay:
    def test_in_order_deltas_pass_and_repeats_are_dropped(self):
        relay = Relay(exact=True)
        assert [d.text for d in relay.accept([Delta(1, 0, "ab"), Delta(1, 2, "cd"), Delta(1, 2, "cd")])] == ["ab", "cd"]
        assert [d.text for d in relay.accept([Delta(1, 3, "de")])] == ["e"], "the overlap is dropped"
        assert relay.rest({"message": {"content": "abcdefg"}}) == "fg"

    def test_after_a_gap_the_rest_comes_from_the_result(self):
        relay = Relay(exact=True)
        relay.accept([Delta(1, 0, "ab")])
        assert relay.accept([Delta(1, 4, "ef"), Delta(1, 6, "g")]) == [] and relay.gap
        assert relay.rest({"message": {"content": "abcdefg"}}) == "cdefg"

    def test_an_exact_relay_breaks_on_a_retry_after_text_went_out(self):
        relay = Relay(exact=True)
        relay.accept([Delta(1, 0, "partial")])
        assert relay.accept([Delta(2, 0, "other")]) == [] and relay.broken
        assert relay.rest({"message": {"content": "other answer"}}) is None

    def test_an_exact_relay_follows_a_retry_when_nothing_went_out_yet(self):
        relay = Relay(exact=True)
        assert [d.text for d in relay.accept([Delta(2, 0, "fresh")])] == ["fresh"] and not relay.broken

    def test_a_loose_relay_joins_late_and_starts_over_with_each_attempt(self):
        relay = Relay(exact=False)
        assert relay.accept([Delta(1, 5, "fgh")]) == [Delta(1, 5, "fgh")]
        assert relay.rest({"message": {"content": "abcdefghij"}}) == "ij"
        assert relay.accept([Delta(2, 0, "new")]) == [Delta(2, 0, "new")] and not relay.broken
