"""Token counting where a server does not report usage. Free of Django, so simllm can use it."""

from typing import Any


def count_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word, plus 4 per message for the
    role framing, which is close to what OpenAI-style servers report for short English prompts."""
    return sum(4 + len(str(m.get("content") or "").split()) for m in messages)
