"""Layer 1, steps 2-4 of encoding: normalization and pre-tokenization, the byte alphabet, and
merges by rank.

The byte-level BPE of GPT-2, which SmolLM2, LLaMA 3 and Qwen 2/2.5/3 also use, applied to text
that holds no added token (those are cut out before, in :mod:`minipaged.tokenizer.added_tokens`):

2. **Pre-tokenization.** The text is normalized if the vocabulary asks for it (Qwen 2's NFC),
   then regular expressions cut it into "words" (a letter run with its leading space, a group of
   digits, a punctuation run, a whitespace run). Merges never cross these edges. The patterns of
   GPT-2, LLaMA 3 and Qwen 2 are here, with the GGUF pre-tokenizer names that stand for them.
3. **Bytes as characters.** Each word becomes its UTF-8 bytes, and each byte is spelled as one
   printable Unicode character (GPT-2's byte-to-unicode map), so the vocabulary is plain strings
   and any byte sequence, even invalid UTF-8, can be encoded.
4. **Merges by rank.** Starting from single bytes, the adjacent pair with the lowest rank in the
   merge list is joined, again and again, until no listed pair remains; the pieces left are
   looked up in the vocabulary. Results are cached per word because text repeats its words.
"""

from __future__ import annotations

import functools
import math
import unicodedata
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

import regex


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used: no tokenizer data, not byte-level BPE, malformed."""


# ---------------------------------------------------------------------------------------------
# The byte alphabet
# ---------------------------------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each of the 256 byte values to a printable Unicode character.

    Printable Latin-1 bytes stand for themselves; the other 68 (control characters, space, ...)
    are moved to U+0100 and up, in byte order. So a space is spelled "Ġ" and a newline "Ċ".
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = [b for b in range(256) if b not in printable]
    mapping = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(shifted)}
    return dict(sorted(mapping.items()))


BYTE_TO_UNICODE: dict[int, str] = bytes_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}


def spell(data: bytes) -> str:
    """``data`` spelled in the byte alphabet, one character per byte."""
    return "".join(BYTE_TO_UNICODE[b] for b in data)


def unspell(token: str) -> bytes:
    """The bytes of a token spelled in the byte alphabet. A string outside the alphabet is taken
    as raw text (as the `tokenizers` ByteLevel decoder does)."""
    try:
        return bytes(UNICODE_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def to_byte_alphabet(text: str) -> str:
    """A vocabulary string in the byte alphabet: kept if it already is, else its UTF-8 spelled
    (llama.cpp stores control tokens such as ``<|im_end|>`` as raw text)."""
    if all(c in UNICODE_TO_BYTE for c in text):
        return text
    return spell(text.encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# Pre-tokenization: text -> words
# ---------------------------------------------------------------------------------------------

# GPT-2's pre-tokenizer: contractions, letter runs, digit runs and punctuation runs (each with
# at most one leading space), then whitespace. `\s+(?!\S)` leaves the last space of a run to
# the next word, so " the" stays one token. `tokenizers`' ByteLevel step uses it when
# `use_regex` is true.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# LLaMA 3's (the `Split` step of its tokenizer.json): case-insensitive contractions, a letter
# run with at most one leading non-letter, numbers in groups of at most three digits, and
# newlines kept apart from other whitespace.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen 2's (also Qwen 2.5's and Qwen 3's): LLaMA 3's with single digits.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# GGUF `tokenizer.ggml.pre` names the pre-tokenizer a vocabulary was trained with. The names map
# to patterns (applied in turn) as in `transformers`' GGUF loader, our reference: names it does
# not list, "smollm" among them, get GPT-2's pattern. (llama.cpp, like the original SmolLM2
# tokenizer.json, first cuts "smollm" text at every digit, which gives other ids around digits:
# "  2" is "Ġ" "Ġ2" for GPT-2 but "ĠĠ" "2" after the digit cut. A tokenizer.json's `Digits`
# step is honoured.)
GGUF_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "smollm", "starcoder"), (GPT2_PATTERN,)),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx"),
        (LLAMA3_PATTERN,),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (QWEN2_PATTERN,)),
}


@dataclass(frozen=True)
class Normalizer:
    """Unicode normal forms applied in turn (``NFC`` alone for Qwen 2) to text outside the
    raw added tokens, before pre-tokenization."""

    forms: tuple[str, ...]

    def __call__(self, text: str) -> str:
        for form in self.forms:
            text = unicodedata.normalize(form, text)
        return text


def split_isolated(pattern: regex.Pattern[str], text: str) -> list[str]:
    """Cut ``text`` into the matches of ``pattern`` and the gaps between them, in order.

    This is the `tokenizers` library's ``Split(behavior="isolated")``: nothing is lost, so the
    pieces join back to ``text``.
    """
    if pattern.groups == 0:
        pieces = pattern.findall(text)
        if sum(map(len, pieces)) == len(text):  # the usual case: the pattern covers everything
            return pieces
    # Every match's edges (and the text's) cut it; the pieces lie between consecutive cuts.
    cuts = sorted({0, len(text), *(i for match in pattern.finditer(text) for i in match.span())})
    return [text[start:end] for start, end in zip(cuts, cuts[1:], strict=False)]


@dataclass
class PreTokenizer:
    """Cuts text into words the way a `tokenizers` ``Sequence`` of ``Split`` steps followed by a
    ``ByteLevel`` step does.

    Args:
        patterns: the ``Split`` regexes, applied in order, each to the pieces of the one before.
        add_prefix_space: the ByteLevel step puts a space in front of each piece that does not
            start with one, so the first word is spelled like any other (GPT-2's option).
        byte_level_split: the ByteLevel step then cuts each piece with GPT-2's pattern
            (``use_regex``).
    """

    patterns: Sequence[str] = ()
    _: KW_ONLY
    add_prefix_space: bool = False
    byte_level_split: bool = False

    def __post_init__(self) -> None:
        self.patterns = tuple(self.patterns)
        self._compiled = [regex.compile(p) for p in self.patterns]
        self._byte_level = regex.compile(GPT2_PATTERN) if self.byte_level_split else None

    def split(self, text: str) -> list[str]:
        """The words of ``text``, in order; they join back to ``text`` (plus prefix spaces)."""
        pieces = [text] if text else []
        for pattern in self._compiled:
            pieces = _split_all(pattern, pieces)
        if self.add_prefix_space:
            pieces = [p if p.startswith(" ") else " " + p for p in pieces]
        if self._byte_level is not None:
            pieces = _split_all(self._byte_level, pieces)
        return pieces


def _split_all(pattern: regex.Pattern[str], pieces: list[str]) -> list[str]:
    return [w for p in pieces for w in split_isolated(pattern, p)]


# ---------------------------------------------------------------------------------------------
# Merges by rank: word -> ids
# ---------------------------------------------------------------------------------------------


class BPE:
    """The BPE model: a vocabulary, a ranked merge list, and a bounded cache of word ids.

    Args:
        vocab: token string (spelled in the byte alphabet) -> id.
        merges: merge pairs, highest priority first.
        ignore_merges: look a whole word up in the vocabulary before merging (LLaMA 3 sets it;
            `tokenizers` does the lookup on the spelled word, then merges if it is absent).
        unk_token_id: id for bytes missing from the vocabulary. With None such a byte is
            dropped, as `tokenizers` does (a vocabulary may lack byte values that never occurred
            in its training text).
        cache_size: how many distinct words keep their token ids cached.
    """

    def __init__(
        self,
        vocab: dict[str, int],
        merges: Sequence[tuple[str, str]],
        *,
        ignore_merges: bool = False,
        unk_token_id: int | None = None,
        cache_size: int = 100_000,
    ) -> None:
        if not vocab:
            raise TokenizerError("empty vocabulary")
        self.vocab = dict(vocab)
        # Rank of each merge pair: lower merges first. First occurrence wins on duplicates. Both
        # halves and the merged token must be in the vocabulary (`tokenizers` refuses such a
        # model too), or encoding would produce a token without an id.
        self.merge_ranks: dict[tuple[str, str], int] = {}
        for rank, pair in enumerate(merges):
            for token in (*pair, "".join(pair)):
                if token not in self.vocab:
                    raise TokenizerError(
                        f"merge {rank} ({' '.join(pair)!r}) needs {token!r}, which is not in the "
                        "vocabulary"
                    )
            self.merge_ranks.setdefault(tuple(pair), rank)
        self.ignore_merges = ignore_merges
        self.unk_token_id = unk_token_id
        # The same word always gives the same ids: ``word_ids`` is the cached entry point.
        self.word_ids = functools.lru_cache(maxsize=cache_size)(self._word_ids)

    @property
    def cached_words(self) -> int:
        """How many distinct words have their ids in the cache now."""
        return self.word_ids.cache_info().currsize

    def clear_cache(self) -> None:
        """Forget every cached word (the next encode of each goes through the merges again)."""
        self.word_ids.cache_clear()

    def _word_ids(self, word: str) -> tuple[int, ...]:
        """Ids of one pre-token: its bytes spelled in the byte alphabet, merged by rank."""
        spelled = spell(word.encode("utf-8"))
        vocab = self.vocab
        if self.ignore_merges and spelled in vocab:
            return (vocab[spelled],)
        if self.unk_token_id is None:
            # A byte with no token is dropped before merging, so its neighbours can merge
            # (what `tokenizers` does; llama.cpp differs slightly). Only bytes that were rare in
            # the vocabulary's training text are missing, e.g. SmolLM2 has no 0x04 or 0xF1.
            spelled = "".join(c for c in spelled if c in vocab)
        return tuple(vocab.get(piece, self.unk_token_id) for piece in self.merge(spelled))

    def merge(self, spelled: str) -> list[str]:
        """Merge the characters of one spelled word by rank (GPT-2's algorithm).

        Each round finds the adjacent pair with the lowest merge rank and joins every
        occurrence of it, left to right; it stops when no adjacent pair is in the merge list.
        (`tokenizers` joins one occurrence at a time, leftmost first, from a priority queue;
        for a merge list learnt by BPE training the result is the same, and it is tested.)
        """
        symbols = list(spelled)
        ranks = self.merge_ranks
        while len(symbols) > 1:
            # The first of the adjacent pairs with the lowest rank; stop when none is ranked.
            pairs = zip(symbols, symbols[1:], strict=False)
            best = min(pairs, key=lambda pair: ranks.get(pair, math.inf))
            if best not in ranks:
                break
            first, second = best
            i = 0
            while i < len(symbols) - 1:
                if symbols[i] == first and symbols[i + 1] == second:
                    symbols[i : i + 2] = [first + second]
                i += 1
        return symbols
