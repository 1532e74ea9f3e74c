"""Layer 1, step 1 of encoding: added tokens are cut out of the text before anything else.

Special tokens such as ``<|im_start|>`` (and user-defined ones such as Qwen 3's ``<think>``) are
matched whole, longest match first, so that they are never split into pieces: text that merely
contains ``<|im_start|>`` gives the token's id, as in `tokenizers` and llama.cpp. The text
between them goes on to the byte-level BPE (:mod:`minipaged.tokenizer.bpe`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import regex


@dataclass(frozen=True)
class AddedToken:
    """A token matched whole in the raw text before pre-tokenization.

    ``special`` tokens (control tokens such as ``<|im_end|>``) are dropped by
    ``decode(..., skip_special_tokens=True)``. ``lstrip``/``rstrip`` let the match swallow the
    whitespace on that side. ``normalized`` tokens are matched after the normalizer has run.
    """

    content: str
    id: int
    special: bool = True
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False


# One run of the text: (text, None) for ordinary text, (matched text, token) for an added token.
Segment = tuple[str, AddedToken | None]


class AddedTokens:
    """The added tokens of a vocabulary, and the matching that cuts them out of text.

    Tokens with ``normalized=False`` are matched in the raw text, the others in the text the
    normalizer gives (as the `tokenizers` library does).
    """

    def __init__(self, tokens: Iterable[AddedToken]) -> None:
        self.tokens: tuple[AddedToken, ...] = tuple(sorted(tokens, key=lambda t: t.id))
        self._by_content = {t.content: t for t in self.tokens}
        self.special_ids = frozenset(t.id for t in self.tokens if t.special)
        self._raw = _alternation(t for t in self.tokens if not t.normalized)
        self._normalized = _alternation(t for t in self.tokens if t.normalized)

    def get(self, content: str) -> AddedToken | None:
        """The added token whose text is ``content``, or None."""
        return self._by_content.get(content)

    def split(self, text: str, normalized: bool) -> list[Segment]:
        """Cut ``text`` at the raw (or, with ``normalized``, the normalized) added tokens."""
        pattern = self._normalized if normalized else self._raw
        if pattern is None:
            return [(text, None)] if text else []
        # Every match's edges (and the text's) cut the text; a piece that starts where a match
        # does is that match (no match is empty), any other is ordinary text.
        matches = list(pattern.finditer(text))
        tokens = {match.start(): self._by_content[match.group("c")] for match in matches}
        cuts = sorted({0, len(text), *(i for match in matches for i in match.span())})
        pieces = zip(cuts, cuts[1:], strict=False)
        return [(text[start:end], tokens.get(start)) for start, end in pieces]


def _alternation(tokens: Iterable[AddedToken]) -> regex.Pattern[str] | None:
    """One alternation matching any of ``tokens``; longer first, so the longest match wins.

    Group ``c`` captures the token itself (without the whitespace ``lstrip``/``rstrip`` take).
    """
    alternatives = [
        (r"\s*" if t.lstrip else "")
        + f"(?P<c>{regex.escape(t.content)})"
        + (r"\s*" if t.rstrip else "")
        for t in sorted(tokens, key=lambda t: len(t.content), reverse=True)
        if t.content
    ]
    if not alternatives:
        return None
    return regex.compile("(?:" + "|".join(alternatives) + ")")
