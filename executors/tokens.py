"""Token counting where a server does not report usage, and the simulators' embeddings. Free of
Django, so simllm can use it."""

import hashlib
import struct
from typing import Any


def count_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word, plus 4 per message for the
    role framing, which is close to what OpenAI-style servers report for short English prompts."""
    return sum(4 + len(str(m.get("content") or "").split()) for m in messages)


def embedding_inputs(value: Any) -> list[str]:
    """The texts of an embeddings request's `input`: a string, a list of strings, or token ids (a
    list of ints, or a list of such lists), which the simulators treat as text."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, int) for item in value):
        return [" ".join(map(str, value))]
    if isinstance(value, list):
        return [item if isinstance(item, str) else " ".join(map(str, item)) for item in value]
    return []


def simulated_embedding(text: str, dims: int) -> list[float]:
    """A deterministic unit vector for a text: the same text always gets the same vector."""
    raw = b""
    counter = 0
    while len(raw) < 4 * dims:
        raw += hashlib.sha256(f"{counter}:{text}".encode()).digest()
        counter += 1
    values = [v / 2**31 - 1 for v in struct.unpack(f"<{dims}I", raw[: 4 * dims])]
    norm = sum(v * v for v in values) ** 0.5 or 1.0
    return [round(v / norm, 6) for v in values]
