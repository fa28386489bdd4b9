"""Turning a growing list of token ids into text deltas that concatenate to the full text."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes the whole output each time and hands out only the new suffix.

    Decoding everything (not token by token) keeps characters that span tokens intact; a delta is
    held back while the text ends in U+FFFD, i.e. in the middle of a multi-byte character.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = ""

    def text_of(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> str:
        self.tokens += tokens
        text = self.text_of(self.tokens)
        if not text.startswith(self.emitted) or text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta

    def flush(self) -> str:
        text = self.text_of(self.tokens)
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta
