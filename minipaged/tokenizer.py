"""Layer 1: a byte-level BPE tokenizer, written from scratch.

The tokenizer of GPT-2 and of most LLaMA-family chat models (SmolLM2, LLaMA 3, Qwen 2) works in
four steps, each small enough to read here:

1. **Added tokens first.** Special tokens such as ``<|im_start|>`` are cut out of the text before
   anything else happens, longest match first, so that they are never split into pieces.
2. **Pre-tokenization.** A regular expression cuts the rest into "words" (a letter run with its
   leading space, a digit, a punctuation run, a whitespace run). Merges never cross these edges.
3. **Bytes as characters.** Each word becomes its UTF-8 bytes, and each byte is spelled as one
   printable Unicode character (GPT-2's byte-to-unicode map), so the vocabulary is plain strings
   and any byte sequence, even invalid UTF-8, can be encoded.
4. **Merges by rank.** Starting from single bytes, the adjacent pair with the lowest rank in the
   merge list is joined, again and again, until no listed pair remains; the pieces left are
   looked up in the vocabulary. Results are cached per word because text repeats its words.

Decoding reverses step 3: token strings back to bytes, bytes to text (invalid fragments become
U+FFFD). :class:`IncrementalDetokenizer` does the same one token at a time for streaming and
never emits half a character.

The vocabulary comes from a GGUF file's ``tokenizer.ggml.*`` metadata (what llama.cpp writes) or
from a Hugging Face ``tokenizer.json``. Chat templates are the model's own Jinja templates,
rendered in a sandbox the way ``transformers`` renders them.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
import unicodedata
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import regex

__all__ = [
    "AddedToken",
    "IncrementalDetokenizer",
    "PreTokenizer",
    "Tokenizer",
    "TokenizerError",
    "bytes_to_unicode",
]


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used: no tokenizer data, not byte-level BPE, malformed."""


# ---------------------------------------------------------------------------------------------
# Data: the byte alphabet, the pre-tokenizer patterns, added tokens
# ---------------------------------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each of the 256 byte values to a printable Unicode character.

    Printable Latin-1 bytes stand for themselves; the other 68 (control characters, space, ...)
    are moved to U+0100 and up, in byte order. So a space is spelled "Ġ" and a newline "Ċ".
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return dict(sorted(mapping.items()))


BYTE_TO_UNICODE: dict[int, str] = bytes_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}

# GPT-2's pre-tokenizer: contractions, letter runs, digit runs and punctuation runs (each with
# at most one leading space), then whitespace. `\s+(?!\S)` leaves the last space of a run to
# the next word, so " the" stays one token.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# LLaMA 3's (also used by many later models): case-insensitive contractions, numbers in groups
# of at most three digits, and newlines kept apart from other whitespace.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen 2's: LLaMA 3's with single digits.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ByteLevel with `use_regex: false` splits nothing: each piece stays one word.
WHOLE_PATTERN = r"(?s).+"

# GGUF `tokenizer.ggml.pre` names the pre-tokenizer a vocabulary was trained with. The names map
# to patterns (applied in turn) as in `transformers`' GGUF loader, our reference: names it does
# not list, "smollm" among them, get GPT-2's pattern. (llama.cpp, like the original SmolLM2
# tokenizer.json, first cuts "smollm" text at every digit, which gives other ids around digits:
# "  2" is "Ġ" "Ġ2" for GPT-2 but "ĠĠ" "2" after the digit cut. A tokenizer.json's `Digits`
# step is honoured.)
GGUF_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (GPT2_PATTERN,),
    "gpt2": (GPT2_PATTERN,),
    "gpt-2": (GPT2_PATTERN,),
    "smollm": (GPT2_PATTERN,),
    "starcoder": (GPT2_PATTERN,),
    "llama3": (LLAMA3_PATTERN,),
    "llama-v3": (LLAMA3_PATTERN,),
    "llama-bpe": (LLAMA3_PATTERN,),
    "smaug-bpe": (LLAMA3_PATTERN,),
    "falcon3": (LLAMA3_PATTERN,),
    "falcon-h1": (LLAMA3_PATTERN,),
    "pixtral": (LLAMA3_PATTERN,),
    "dbrx": (LLAMA3_PATTERN,),
    "qwen2": (QWEN2_PATTERN,),
    "deepseek-r1-qwen": (QWEN2_PATTERN,),
}

# GGUF token types (gguf.TokenType): which vocabulary entries are "added" tokens.
GGUF_TOKEN_NORMAL = 1
GGUF_TOKEN_CONTROL = 3
GGUF_TOKEN_USER_DEFINED = 4


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


# ---------------------------------------------------------------------------------------------
# Pre-tokenization: text -> words
# ---------------------------------------------------------------------------------------------


def _split_isolated(pattern: regex.Pattern[str], text: str) -> list[str]:
    """Cut ``text`` into the matches of ``pattern`` and the gaps between them, in order.

    This is the `tokenizers` library's ``Split(behavior="isolated")``: nothing is lost, so the
    pieces join back to ``text``.
    """
    if pattern.groups == 0:
        pieces = pattern.findall(text)
        if sum(map(len, pieces)) == len(text):  # the usual case: the pattern covers everything
            return pieces
    pieces = []
    last = 0
    for match in pattern.finditer(text):
        start, end = match.span()
        if start > last:
            pieces.append(text[last:start])
        if end > start:
            pieces.append(text[start:end])
        last = end
    if last < len(text):
        pieces.append(text[last:])
    return pieces


class PreTokenizer:
    """Cuts text into words by applying regex splits in sequence (each on the previous pieces).

    ``add_prefix_space`` is GPT-2's option to treat the first word like any other: a space is
    put in front of each piece that does not start with one, before the last split.
    """

    def __init__(self, patterns: Sequence[str], add_prefix_space: bool = False) -> None:
        if not patterns:
            raise TokenizerError("a pre-tokenizer needs at least one split pattern")
        self.patterns = tuple(patterns)
        self.add_prefix_space = add_prefix_space
        self._compiled = [regex.compile(p) for p in self.patterns]

    def split(self, text: str) -> list[str]:
        """The words of ``text``, in order; they join back to ``text`` (plus prefix spaces)."""
        pieces = [text]
        last = len(self._compiled) - 1
        for i, pattern in enumerate(self._compiled):
            if i == last and self.add_prefix_space:
                pieces = [p if p.startswith(" ") else " " + p for p in pieces]
            if len(pieces) == 1:
                pieces = _split_isolated(pattern, pieces[0])
            else:
                pieces = [w for p in pieces for w in _split_isolated(pattern, p)]
        return pieces

    def __repr__(self) -> str:
        return f"PreTokenizer({list(self.patterns)!r}, add_prefix_space={self.add_prefix_space})"


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------

Normalizer = Callable[[str], str]


class Tokenizer:
    """A byte-level BPE tokenizer: encode, decode, chat templates.

    Build one with :meth:`from_gguf`, :meth:`from_tokenizer_json` or :meth:`from_pretrained`;
    the constructor takes the already-parsed parts.

    Args:
        vocab: token string (spelled in the byte alphabet) -> id.
        merges: merge pairs, highest priority first.
        added_tokens: tokens matched whole in the raw text (special and user-defined).
        pre_tokenizer: how text is cut into words before merging.
        bos_token_id, eos_token_id, pad_token_id: the model's special ids, or None.
        add_bos_token, add_eos_token: whether ``encode(..., add_special_tokens=True)`` adds them.
        chat_template: the model's Jinja chat template, or None.
        normalizer: applied to text outside added tokens before pre-tokenization, or None.
        ignore_merges: look a whole word up in the vocabulary before merging (LLaMA 3 sets it).
        unk_token_id: id for bytes missing from the vocabulary. With None such a byte is
            dropped, as `tokenizers` does (a vocabulary may lack byte values that never occurred
            in its training text).
        cache_size: how many distinct words keep their token ids cached.
    """

    def __init__(
        self,
        vocab: dict[str, int],
        merges: Sequence[tuple[str, str]],
        added_tokens: Iterable[AddedToken] = (),
        pre_tokenizer: PreTokenizer | None = None,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        normalizer: Normalizer | None = None,
        ignore_merges: bool = False,
        unk_token_id: int | None = None,
        cache_size: int = 100_000,
    ) -> None:
        if not vocab:
            raise TokenizerError("empty vocabulary")
        self.vocab = dict(vocab)
        # Rank of each merge pair: lower merges first. First occurrence wins on duplicates.
        self.merge_ranks: dict[tuple[str, str], int] = {}
        for rank, pair in enumerate(merges):
            self.merge_ranks.setdefault(tuple(pair), rank)
        self.added_tokens = sorted(added_tokens, key=lambda t: t.id)
        self.pre_tokenizer = pre_tokenizer or PreTokenizer([GPT2_PATTERN])
        self.normalizer = normalizer
        self.ignore_merges = ignore_merges
        self.unk_token_id = unk_token_id
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self._chat_template = chat_template

        self._added_by_content = {t.content: t for t in self.added_tokens}
        self._special_ids = frozenset(t.id for t in self.added_tokens if t.special)
        self._raw_added_regex = _added_token_regex(t for t in self.added_tokens if not t.normalized)
        self._normalized_added_regex = _added_token_regex(
            t for t in self.added_tokens if t.normalized
        )

        # id -> token string and id -> bytes, for decoding. Added tokens are raw text.
        size = max([*self.vocab.values(), *(t.id for t in self.added_tokens)]) + 1
        self._id_to_token: list[str | None] = [None] * size
        self._id_to_bytes: list[bytes] = [b""] * size
        for token, i in self.vocab.items():
            self._id_to_token[i] = token
            self._id_to_bytes[i] = _token_bytes(token)
        for t in self.added_tokens:
            self._id_to_token[t.id] = t.content
            self._id_to_bytes[t.id] = t.content.encode("utf-8")

        # The per-word cache: the same word always gives the same ids.
        self._word_ids = functools.lru_cache(maxsize=cache_size)(self._bpe_word_ids)

    # -- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding rows)."""
        return len(self._id_to_token)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def bos_token(self) -> str | None:
        return None if self._bos_token_id is None else self.id_to_token(self._bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self._eos_token_id is None else self.id_to_token(self._eos_token_id)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special added tokens (dropped by ``skip_special_tokens``)."""
        return self._special_ids

    def token_to_id(self, token: str) -> int | None:
        """The id of an added token's text or a vocabulary string; None if there is none."""
        added = self._added_by_content.get(token)
        if added is not None:
            return added.id
        return self.vocab.get(token)

    def id_to_token(self, token_id: int) -> str:
        """The token string of an id (vocabulary spelling, or an added token's text)."""
        token = self._id_to_token[self._check_id(token_id)]
        if token is None:
            raise TokenizerError(f"token id {token_id} has no token in this vocabulary")
        return token

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token id stands for (a fragment of UTF-8 for most byte-level tokens)."""
        return self._id_to_bytes[self._check_id(token_id)]

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._id_to_token):
            raise TokenizerError(
                f"token id {token_id} is out of range for a vocabulary of {self.vocab_size}"
            )
        return token_id

    # -- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Added tokens in the text are always matched whole.

        ``add_special_tokens`` puts bos in front (and eos at the end) only where the model's
        metadata says so (``add_bos_token``/``add_eos_token``); chat templates add their own.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        ids: list[int] = []
        if add_special_tokens and self.add_bos_token and self._bos_token_id is not None:
            ids.append(self._bos_token_id)
        for raw_piece, raw_token in _split_on(self._raw_added_regex, text, self._added_by_content):
            if raw_token is not None:
                ids.append(raw_token.id)
                continue
            piece = self.normalizer(raw_piece) if self.normalizer else raw_piece
            for sub, token in _split_on(
                self._normalized_added_regex, piece, self._added_by_content
            ):
                if token is not None:
                    ids.append(token.id)
                else:
                    self._encode_ordinary(sub, ids)
        if add_special_tokens and self.add_eos_token and self._eos_token_id is not None:
            ids.append(self._eos_token_id)
        return ids

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        """Append the ids of text that holds no added token. The hot path: one cache hit/word."""
        word_ids = self._word_ids
        for word in self.pre_tokenizer.split(text):
            out.extend(word_ids(word))

    def _bpe_word_ids(self, word: str) -> tuple[int, ...]:
        """Ids of one pre-token: its bytes spelled in the byte alphabet, merged by rank."""
        spelled = "".join(BYTE_TO_UNICODE[b] for b in word.encode("utf-8"))
        vocab = self.vocab
        if self.ignore_merges and spelled in vocab:
            return (vocab[spelled],)
        if self.unk_token_id is None:
            # A byte with no token is dropped before merging, so its neighbours can merge
            # (what `tokenizers` does; llama.cpp differs slightly). Only bytes that were rare in
            # the vocabulary's training text are missing, e.g. SmolLM2 has no 0x04 or 0xF1.
            spelled = "".join(c for c in spelled if c in vocab)
        return tuple(vocab.get(piece, self.unk_token_id) for piece in self.bpe(spelled))

    def bpe(self, spelled: str) -> list[str]:
        """Merge the characters of one spelled word by rank (GPT-2's algorithm).

        Each round finds the adjacent pair with the lowest merge rank and joins every
        occurrence of it, left to right; it stops when no adjacent pair is in the merge list.
        (`tokenizers` joins one occurrence at a time, leftmost first, from a priority queue;
        for a merge list learnt by BPE training the result is the same, and it is tested.)
        """
        symbols = list(spelled)
        ranks = self.merge_ranks
        while len(symbols) > 1:
            best_rank, best = None, None
            for pair in zip(symbols, symbols[1:], strict=False):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best = rank, pair
            if best is None:
                break
            first, second = best
            merged: list[str] = []
            i = 0
            while i < len(symbols):
                if i < len(symbols) - 1 and symbols[i] == first and symbols[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    # -- decoding -----------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """The raw bytes of ``ids`` (what :meth:`decode` turns into text)."""
        special = self._special_ids if skip_special_tokens else frozenset()
        return b"".join(self.token_bytes(i) for i in ids if i not in special)

    # -- chat templates -----------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation with the model's own Jinja chat template.

        ``messages`` is a list of ``{"role": ..., "content": ...}`` dicts. With
        ``add_generation_prompt`` the prompt ends with the opening of an assistant turn. Extra
        keyword arguments become template variables (as in ``transformers``). Returns the text,
        or its ids (encoded without adding bos: templates write their own) when ``tokenize``.
        """
        template = chat_template if chat_template is not None else self._chat_template
        if template is None:
            raise TokenizerError("this tokenizer has no chat template")
        _check_messages(messages)
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": "" if self._pad_token_id is None else self.id_to_token(self._pad_token_id),
            "unk_token": "" if self.unk_token_id is None else self.id_to_token(self.unk_token_id),
            **kwargs,
        }
        text = _compile_chat_template(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )
        return self.encode(text) if tokenize else text

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from a ``.gguf`` file or a folder with ``tokenizer.json`` (+ its config)."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer at {path}: the path does not exist")
        if path.is_dir():
            tokenizer_json = path / "tokenizer.json"
            if not tokenizer_json.is_file():
                ggufs = sorted(path.glob("*.gguf"))
                if len(ggufs) == 1:
                    return cls.from_gguf(ggufs[0])
                raise FileNotFoundError(f"{path} has no tokenizer.json (and not one .gguf file)")
            config_path = path / "tokenizer_config.json"
            config = _read_json(config_path) if config_path.is_file() else {}
            template_path = path / "chat_template.jinja"
            if "chat_template" not in config and template_path.is_file():
                config["chat_template"] = template_path.read_text(encoding="utf-8")
            return cls.from_tokenizer_json(tokenizer_json, config)
        if path.suffix.lower() == ".gguf":
            return cls.from_gguf(path)
        if path.name.endswith(".json"):
            return cls.from_tokenizer_json(path)
        raise TokenizerError(f"{path}: expected a .gguf file, a tokenizer.json or a folder")

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from a GGUF file's ``tokenizer.ggml.*`` metadata (llama.cpp's layout)."""
        fields = _read_gguf_tokenizer_fields(path)
        model = fields.get("tokenizer.ggml.model")
        if model is None or "tokenizer.ggml.tokens" not in fields:
            raise TokenizerError(f"{path}: the GGUF file has no tokenizer metadata")
        if model != "gpt2":
            raise TokenizerError(
                f"{path}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is "
                "supported"
            )
        if "tokenizer.ggml.merges" not in fields:
            raise TokenizerError(f"{path}: the GGUF BPE vocabulary has no tokenizer.ggml.merges")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [GGUF_TOKEN_NORMAL] * len(
            tokens
        )
        if len(types) != len(tokens):
            raise TokenizerError(
                f"{path}: {len(tokens)} tokens but {len(types)} entries in token_type"
            )
        vocab: dict[str, int] = {}
        added: list[AddedToken] = []
        for i, (token, token_type) in enumerate(zip(tokens, types, strict=True)):
            # llama.cpp stores control / user-defined tokens as raw text; normal tokens are
            # already spelled in the byte alphabet. Spell any raw one so the vocabulary is
            # uniform (as transformers' GGUF loader does).
            vocab.setdefault(_spell(token), i)
            if token_type in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED):
                added.append(AddedToken(token, i, special=token_type == GGUF_TOKEN_CONTROL))
        merges = [_parse_merge(m, path) for m in fields["tokenizer.ggml.merges"]]
        pre = fields.get("tokenizer.ggml.pre", "default")
        patterns = GGUF_PRE_TOKENIZERS.get(pre)
        if patterns is None:
            warnings.warn(
                f"{path}: unknown pre-tokenizer {pre!r}; using GPT-2's split pattern",
                stacklevel=2,
            )
            patterns = (GPT2_PATTERN,)
        return cls(
            vocab,
            merges,
            added,
            # tokenizer.ggml.add_space_prefix is for SentencePiece; llama.cpp ignores it for BPE.
            PreTokenizer(patterns),
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
            # No unk for BPE pieces: llama.cpp drops a byte missing from the vocabulary.
            add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            add_eos_token=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=fields.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_tokenizer_json(
        cls, path: str | os.PathLike[str], tokenizer_config: dict[str, Any] | None = None
    ) -> Tokenizer:
        """Load from a Hugging Face ``tokenizer.json``.

        ``tokenizer_config`` is the parsed ``tokenizer_config.json`` (optional): it gives the
        chat template, the bos/eos/pad tokens and ``add_bos_token``/``add_eos_token``.
        """
        data = _read_json(Path(path))
        config = tokenizer_config or {}
        model = data.get("model")
        if (
            not isinstance(model, dict)
            or model.get("type", "BPE") != "BPE"
            or "merges" not in model
        ):
            kind = model.get("type") if isinstance(model, dict) else model
            raise TokenizerError(f"{path}: the model is {kind!r}; only BPE is supported")
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise TokenizerError(f"{path}: BPE with subword prefixes/suffixes is not supported")
        pre_tokenizer = _pre_tokenizer_from_json(data.get("pre_tokenizer"), path)
        _check_decoder(data.get("decoder"), path)
        normalizer = _normalizer_from_json(data.get("normalizer"), path)
        vocab: dict[str, int] = model["vocab"]
        merges = [
            _parse_merge(m, path) if isinstance(m, str) else (m[0], m[1]) for m in model["merges"]
        ]
        added = [
            AddedToken(
                t["content"],
                t["id"],
                special=t.get("special", False),
                lstrip=t.get("lstrip", False),
                rstrip=t.get("rstrip", False),
                normalized=t.get("normalized", not t.get("special", False)),
            )
            for t in data.get("added_tokens") or []
        ]
        by_content = {t.content: t.id for t in added}

        def config_id(key: str) -> int | None:
            token = config.get(key)
            if isinstance(token, dict):
                token = token.get("content")
            if token is None:
                return None
            token_id = by_content.get(token, vocab.get(token))
            if token_id is None:
                raise TokenizerError(f"{path}: {key} {token!r} is not in the vocabulary")
            return token_id

        unk = model.get("unk_token")
        return cls(
            vocab,
            merges,
            added,
            pre_tokenizer,
            bos_token_id=config_id("bos_token"),
            eos_token_id=config_id("eos_token"),
            pad_token_id=config_id("pad_token"),
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=_chat_template_from_config(config.get("chat_template")),
            normalizer=normalizer,
            ignore_merges=bool(model.get("ignore_merges", False)),
            unk_token_id=None if unk is None else by_content.get(unk, vocab.get(unk)),
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merge_ranks)}, "
            f"added={len(self.added_tokens)}, bos={self.bos_token_id}, eos={self.eos_token_id})"
        )


# ---------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, emitting only complete UTF-8 characters.

    A token often holds part of a character (an emoji takes several byte-level tokens), so the
    bytes of an unfinished character are held back until the tokens that complete it arrive.
    The concatenation of everything :meth:`push` returns, plus :meth:`finish`, equals
    ``tokenizer.decode(all_ids)``; when that text is valid UTF-8, ``finish()`` returns "".
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chunks: list[str] = []
        self.token_ids: list[int] = []

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        data = self.tokenizer.token_bytes(token_id)
        self.token_ids.append(token_id)
        if self.skip_special_tokens and token_id in self.tokenizer.special_token_ids:
            return ""
        new = self._decoder.decode(data, final=False)
        if new:
            self._chunks.append(new)
        return new

    def finish(self) -> str:
        """End of stream: return held-back bytes of an unfinished character as U+FFFD."""
        rest = self._decoder.decode(b"", final=True)
        if rest:
            self._chunks.append(rest)
        return rest

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)


# ---------------------------------------------------------------------------------------------
# Helpers: byte spelling, added-token matching, chat templates, file parsing
# ---------------------------------------------------------------------------------------------


def _spell(text: str) -> str:
    """A vocabulary string in the byte alphabet: kept if it already is, else its UTF-8 spelled."""
    if all(c in UNICODE_TO_BYTE for c in text):
        return text
    return "".join(BYTE_TO_UNICODE[b] for b in text.encode("utf-8"))


def _token_bytes(token: str) -> bytes:
    """Bytes of a byte-alphabet token string. A string outside the alphabet is taken as raw
    text (as the `tokenizers` ByteLevel decoder does)."""
    try:
        return bytes(UNICODE_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _added_token_regex(tokens: Iterable[AddedToken]) -> regex.Pattern[str] | None:
    """One alternation matching any of ``tokens``; longer first, so the longest match wins.

    Group ``c`` captures the token itself (without the whitespace ``lstrip``/``rstrip`` take).
    """
    alternatives = []
    for t in sorted(tokens, key=lambda t: len(t.content), reverse=True):
        if not t.content:
            continue
        alternatives.append(
            (r"\s*" if t.lstrip else "")
            + "(?P<c>"
            + regex.escape(t.content)
            + ")"
            + (r"\s*" if t.rstrip else "")
        )
    if not alternatives:
        return None
    return regex.compile("(?:" + "|".join(alternatives) + ")")


def _split_on(
    pattern: regex.Pattern[str] | None, text: str, added: dict[str, AddedToken]
) -> list[tuple[str, AddedToken | None]]:
    """Cut ``text`` at the added tokens: (text, None) for ordinary runs, (text, token) for one."""
    if pattern is None:
        return [(text, None)] if text else []
    out: list[tuple[str, AddedToken | None]] = []
    last = 0
    for match in pattern.finditer(text):
        start, end = match.span()
        if start > last:
            out.append((text[last:start], None))
        out.append((match.group(), added[match.group("c")]))
        last = end
    if last < len(text):
        out.append((text[last:], None))
    return out


def _check_messages(messages: Sequence[dict[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizerError("messages must be a list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise TokenizerError(f"messages[{i}] must be a dict with a 'role' (got {message!r})")


class _TemplateError(TokenizerError):
    """Raised by a chat template's own ``raise_exception(...)``."""


def _raise_exception(message: str) -> None:
    raise _TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``tojson`` as transformers defines it (no HTML escaping, unlike Jinja's own)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> Any:
    """Compile a chat template the way ``transformers`` does: a sandboxed, immutable Jinja
    environment with ``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``,
    ``strftime_now`` and a ``tojson`` that does not escape HTML."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """Accept ``{% generation %}...{% endgeneration %}`` (used to mark assistant text for
        training masks) and render its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"the chat template is not valid Jinja: {e}") from e


def _chat_template_from_config(value: Any) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default", next(iter(named.values()), None))
    raise TokenizerError(f"chat_template must be a string or a list, not {type(value).__name__}")


def _parse_merge(merge: str, path: Any) -> tuple[str, str]:
    parts = merge.split(" ")
    if len(parts) != 2:
        raise TokenizerError(f"{path}: malformed merge {merge!r} (expected 'left right')")
    return parts[0], parts[1]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"no such tokenizer file: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object at the top level")
    return data


def _read_gguf_tokenizer_fields(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file, as plain Python values."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct.error/... on a bad header
        raise TokenizerError(f"{path}: not a readable GGUF file ({e})") from e
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if name.startswith("tokenizer.")
    }


def _pre_tokenizer_from_json(spec: dict[str, Any] | None, path: Any) -> PreTokenizer:
    """The pre-tokenizer of a tokenizer.json: ByteLevel, or a Sequence of Split/Digits steps
    ending in ByteLevel (LLaMA 3, SmolLM2, Qwen 2 all look like this)."""
    steps = [spec] if spec is None or spec.get("type") != "Sequence" else spec["pretokenizers"]
    patterns: list[str] = []
    for n, step in enumerate(steps):
        kind = None if step is None else step.get("type")
        if kind == "ByteLevel":
            if n != len(steps) - 1:
                raise TokenizerError(f"{path}: ByteLevel must be the last pre-tokenizer step")
            # Without its own regex, ByteLevel keeps each piece whole (a no-op split, so that
            # the prefix space still goes in front of every piece, as in `tokenizers`).
            patterns.append(GPT2_PATTERN if step.get("use_regex", True) else WHOLE_PATTERN)
            return PreTokenizer(patterns, add_prefix_space=bool(step.get("add_prefix_space")))
        if kind == "Split":
            if step.get("behavior", "Isolated") != "Isolated" or step.get("invert", False):
                raise TokenizerError(
                    f"{path}: Split with behavior {step.get('behavior')!r} / invert is not "
                    "supported (only Isolated)"
                )
            pattern = step["pattern"]
            patterns.append(
                pattern["Regex"] if "Regex" in pattern else regex.escape(pattern["String"])
            )
        elif kind == "Digits":
            patterns.append(r"\p{N}" if step.get("individual_digits", False) else r"\p{N}+")
        else:
            raise TokenizerError(f"{path}: pre-tokenizer {kind!r} is not byte-level BPE")
    raise TokenizerError(f"{path}: no ByteLevel pre-tokenizer; only byte-level BPE is supported")


def _check_decoder(spec: dict[str, Any] | None, path: Any) -> None:
    if spec is None:
        return
    kinds = [spec.get("type")]
    if spec.get("type") == "Sequence":
        kinds = [d.get("type") for d in spec.get("decoders", [])]
    if "ByteLevel" not in kinds:
        raise TokenizerError(f"{path}: decoder {kinds} is not byte-level")


_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}


def _normalizer_from_json(spec: dict[str, Any] | None, path: Any) -> Normalizer | None:
    """Unicode normal forms (alone or in a Sequence) are supported; other normalizers are not."""
    if spec is None:
        return None
    steps = spec["normalizers"] if spec.get("type") == "Sequence" else [spec]
    forms = []
    for step in steps:
        if step.get("type") not in _UNICODE_FORMS:
            raise TokenizerError(f"{path}: normalizer {step.get('type')!r} is not supported")
        forms.append(step["type"])
    if not forms:
        return None

    def normalize(text: str) -> str:
        for form in forms:
            text = unicodedata.normalize(form, text)
        return text

    return normalize
