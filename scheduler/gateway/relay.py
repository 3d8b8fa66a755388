"""What a request relays of a job's streamed output (the deltas its watch on the job feed hears,
scheduler/notify/feed.py), kept in step with them: each piece once, in order, a gap or a retry
seen for what it is.

* `Relay`: a job's output as one reply (the model APIs' streams, scheduler/gateway/calls.py,
  exact; the job stream of a chat, scheduler/gateway/jobwatch.py, loose), its text and its tool
  calls' arguments (`ToolCall`, handed on as `ToolPiece`s).
* `RoundRelay`: a streamed flow's job stream, each round's pieces tagged with the round
  (`RoundOutput`, `RoundPart`), and the cursor a client resumes from."""

from dataclasses import dataclass, field
from typing import Any

from scheduler.notify import broadcast
from scheduler.notify.feed import Delta


@dataclass
class ToolCall:
    """A tool call as a relay has heard it: its arguments so far, and whether a gap was seen."""

    id: str = ""
    name: str = ""
    arguments: str = ""
    gap: bool = False


@dataclass(frozen=True)
class ToolPiece:
    """New arguments of tool call `index`, in order; `first` the first piece relayed of it (its id
    and name known from then on)."""

    index: int
    id: str
    name: str
    text: str
    first: bool


class Relay:
    """A job's output as relayed so far, kept in step with the deltas heard. Each delta says where
    it starts, so a repeated one is dropped and a missed one shows as a gap; a delta of a later
    attempt shows that the model's stream broke off and the job was retried.

    An `exact` relay (the model APIs' streams) must add up to the answer: after a gap it relays
    nothing more (the rest comes from the job's result, `rest()`), and a retry after text or a
    tool call went out leaves it `broken`, since it cannot take back what it sent. It follows the
    tool calls' pieces too, each call on its own (`take_tools()`). A loose one (the job stream, whose deltas
    carry offsets and attempts) may start where it joined and starts over with each attempt."""

    def __init__(self, *, exact: bool) -> None:
        self.exact = exact
        self.base = 0  # where the relayed text starts in the attempt's output
        self.sent = ""
        self.attempt: int | None = None
        self.gap = False
        self.broken = False
        self.tools: dict[int, ToolCall] = {}  # an exact relay's tool calls, by index
        self._tool_pieces: list[ToolPiece] = []

    def accept(self, deltas: list[Delta]) -> list[Delta]:
        """The new, in-order pieces of the reply's text among `deltas`. An exact relay keeps the
        tool calls' pieces for `take_tools()`; a loose one ignores them."""
        fresh = []
        for delta in deltas:
            if delta.part and not self.exact:
                continue
            if self.attempt is None or (
                delta.attempt > self.attempt and not (self.exact and (self.sent or self._relayed_tools()))
            ):
                self.attempt, self.sent, self.gap, self.tools = delta.attempt, "", False, {}
                self.base = 0 if self.exact else delta.offset
            if delta.attempt > self.attempt:
                self.broken = True
            if delta.attempt != self.attempt or self.broken:
                continue
            if delta.part:
                self._accept_tool(delta)
                continue
            if self.gap:
                continue
            have = self.base + len(self.sent)
            if delta.offset > have:
                self.gap = True
            elif delta.offset + len(delta.text) > have:
                text = delta.text[have - delta.offset :]
                fresh.append(Delta(delta.attempt, have, text))
                self.sent += text
        return fresh

    def _accept_tool(self, delta: Delta) -> None:
        """A tool call's piece: relayed once the call's id and name are known, in order; after a
        gap nothing more of that call (the rest comes from the job's result)."""
        index = int(delta.part.removeprefix("tool:") or 0)
        call = self.tools.setdefault(index, ToolCall())
        if call.gap:
            return
        if delta.offset > len(call.arguments):
            call.gap = True
            return
        announced = bool(call.id and call.name)
        call.id, call.name = call.id or delta.id, call.name or delta.name
        new = delta.text[len(call.arguments) - delta.offset :]
        call.arguments += new
        if not announced and call.id and call.name:
            self._tool_pieces.append(ToolPiece(index, call.id, call.name, call.arguments, first=True))
        elif announced and new:
            self._tool_pieces.append(ToolPiece(index, call.id, call.name, new, first=False))

    def _relayed_tools(self) -> bool:
        return any(call.id and call.name for call in self.tools.values())

    def take_tools(self) -> list[ToolPiece]:
        """The tool calls' pieces accepted since the last take, in the order they came."""
        pieces, self._tool_pieces = self._tool_pieces, []
        return pieces

    def rest(self, result: dict[str, Any] | None) -> str | None:
        """What remains to relay of the final text, or None if it does not continue what was sent."""
        full = str(((result or {}).get("message") or {}).get("content") or "")[self.base :]
        return full[len(self.sent) :] if full.startswith(self.sent) else None


@dataclass
class RoundPart:
    """What a flow's job stream has sent of one part of a round's output (its text, or a tool
    call's arguments): how much, the call's id and name, and whether a piece was missed."""

    sent: int = 0
    id: str = ""
    name: str = ""
    gap: bool = False


@dataclass
class RoundOutput:
    """The attempt of an unfinished round that a flow's job stream follows, and its parts."""

    attempt: int
    parts: dict[str, RoundPart] = field(default_factory=dict)


class RoundRelay:
    """The job stream's relay of a streamed flow (scheduler/gateway/jobwatch.py): each round's pieces,
    tagged with the round, in order and each once.

    The rounds before `closed + 1` the client has whole: a round's `round_finished` event goes out
    after the rest of its output, completed from its recorded answer (`close`), so a piece that
    was missed (the stream joined mid-round, a delta lost) comes then, never out of order. A
    later attempt of the open round (a retry, or the round run again after its worker died)
    starts that round over, as a chat's next attempt does. A delta of a round after the open one
    means the open one ended (`behind`): the stream reads the job and closes it first.

    Where the client is (`cursor`) is the SSE id of everything the stream sends for a flow, so a
    client that reconnects with `Last-Event-ID` gets neither a piece twice nor a gap (`resume`)."""

    def __init__(self, *, closed: int = 0, open: dict[int, RoundOutput] | None = None) -> None:
        self.closed = closed
        self.open: dict[int, RoundOutput] = open or {}

    @classmethod
    def resume(cls, last_event_id: str) -> "tuple[int, RoundRelay | None]":
        """The last event id in a cursor, and the relay it describes (None: a plain event id, so
        the rounds it has whole are those whose `round_finished` it has). ValueError if malformed."""
        head, *rest = last_event_id.split(".")
        if not rest:
            return int(head), None
        round_no, attempt, *lengths = (int(n) for n in rest)
        parts = {"": RoundPart(sent=lengths[0])} if lengths else {}
        parts.update({broadcast.tool_part(i): RoundPart(sent=n) for i, n in enumerate(lengths[1:])})
        return int(head), cls(closed=round_no - 1, open={round_no: RoundOutput(attempt, parts)})

    def cursor(self, event_id: int) -> str:
        """Where the client is: the last event sent, then the open round's round, attempt, and how
        much of its text and of each tool call's arguments went out."""
        output = self.open.get(self.closed + 1)
        if output is None:
            return str(event_id)
        tools = [int(part.removeprefix("tool:")) for part in output.parts if part]
        lengths = [
            output.parts.get(p, RoundPart()).sent
            for p in ["", *map(broadcast.tool_part, range(max(tools, default=-1) + 1))]
        ]
        return ".".join(str(n) for n in [event_id, self.closed + 1, output.attempt, *lengths])

    def behind(self, deltas: list[Delta]) -> bool:
        """Whether a delta is of a round past the open one: that one has ended, close it first."""
        return any(delta.round > self.closed + 1 for delta in deltas)

    def accept(self, deltas: list[Delta], event_id: int) -> list[tuple[Delta, str]]:
        """The new, in-order pieces of the open round among `deltas`, each with the cursor after it."""
        fresh = []
        for delta in deltas:
            if delta.round != self.closed + 1:  # a closed round's late piece (its close sent it)
                continue
            output = self.open.get(delta.round)
            if output is None or delta.attempt > output.attempt:
                output = self.open[delta.round] = RoundOutput(delta.attempt)
            elif delta.attempt < output.attempt:
                continue
            part = output.parts.setdefault(delta.part, RoundPart())
            part.id, part.name = part.id or delta.id, part.name or delta.name
            if part.gap or delta.offset > part.sent:
                part.gap = True  # the rest comes with the round's end
                continue
            text = delta.text[part.sent - delta.offset :]
            if text:
                fresh.append((self._sent(delta.round, output, delta.part, part, text), self.cursor(event_id)))
        return fresh

    def close(
        self, round_no: int, attempt: int | None, answer: dict[str, Any] | None, event_id: int
    ) -> list[tuple[Delta, str]]:
        """Round `round_no` ended with `answer` (by its attempt `attempt`): what the client has not
        had of it, each with the cursor after it (the round still open until this returns)."""
        if round_no <= self.closed:
            return []
        output = self.open.get(round_no)
        if output is None or (attempt is not None and attempt != output.attempt):
            # The recorded answer is of an attempt not followed here: it starts the round over.
            output = self.open[round_no] = RoundOutput(attempt if attempt is not None else 1)
        self.closed = round_no - 1  # rounds end in order: this one is the open one its cursors name
        fresh = []
        answer = answer or {}
        wholes = [("", "", "", str(answer.get("content") or ""))]
        for index, call in enumerate(answer.get("tool_calls") or ()):
            function = call.get("function") or {}
            wholes.append(
                (
                    broadcast.tool_part(index),
                    str(call.get("id") or ""),
                    str(function.get("name") or ""),
                    str(function.get("arguments") or ""),
                )
            )
        for part_name, ident, name, whole in wholes:
            part = output.parts.setdefault(part_name, RoundPart())
            part.id, part.name = ident or part.id, name or part.name
            if whole[part.sent :]:
                fresh.append((self._sent(round_no, output, part_name, part, whole[part.sent :]), self.cursor(event_id)))
        del self.open[round_no]
        self.closed = round_no
        return fresh

    @staticmethod
    def _sent(round_no: int, output: RoundOutput, part_name: str, part: RoundPart, text: str) -> Delta:
        delta = Delta(output.attempt, part.sent, text, part_name, part.id, part.name, round_no)
        part.sent += len(text)
        return delta
