"""Layer 1: the tokenizer, text <-> token ids, written from scratch.

:class:`Tokenizer` is the byte-level BPE of GPT-2 and of the chat models built on it (SmolLM2,
LLaMA 3, Qwen 2/2.5/3). It encodes in four steps, each in a small module of its own:

1. cut the added tokens (``<|im_start|>``, ...) out of the text, longest match first
   (:mod:`minipaged.tokenizer.added_tokens`);
2. normalize the rest, if the vocabulary asks for it (Qwen 2's NFC), and cut it into words with
   the vocabulary's split patterns (:class:`~minipaged.tokenizer.bpe.PreTokenizer`);
3. spell each word's UTF-8 bytes as one printable character per byte;
4. merge adjacent pieces by rank and look them up in the vocabulary
   (:class:`~minipaged.tokenizer.bpe.BPE`, which caches each word's ids).

Decoding reverses step 3: token strings back to bytes, bytes to text (invalid fragments become
U+FFFD). :class:`IncrementalDetokenizer` does the same one token at a time for streaming and
never emits half a character. Chat templates (:mod:`minipaged.tokenizer.chat_template`) are the
model's own Jinja templates, rendered as ``transformers`` renders them. The files are read by
:mod:`minipaged.tokenizer.files`: a GGUF file's metadata or a Hugging Face tokenizer folder.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable, Sequence
from typing import Any

from minipaged.tokenizer.added_tokens import AddedToken, AddedTokens
from minipaged.tokenizer.bpe import BPE, GPT2_PATTERN, PreTokenizer, TokenizerError, unspell
from minipaged.tokenizer.chat_template import render_chat_template
from minipaged.tokenizer.files import (
    Normalizer,
    read_gguf,
    read_pretrained,
    read_tokenizer_json,
)

__all__ = ["AddedToken", "IncrementalDetokenizer", "PreTokenizer", "Tokenizer", "TokenizerError"]


class Tokenizer:
    """A byte-level BPE tokenizer: encode, decode, chat templates.

    Build one with :meth:`from_pretrained`, :meth:`from_gguf` or :meth:`from_tokenizer_json`;
    the constructor takes the already-parsed parts.

    Args:
        vocab: token string (spelled in the byte alphabet) -> id.
        merges: merge pairs, highest priority first.
        added_tokens: tokens matched whole in the raw text (special and user-defined).
        pre_tokenizer: how text is cut into words before merging (default: GPT-2's pattern).
        bos_token_id, eos_token_id, pad_token_id: the model's special ids, or None.
        add_bos_token, add_eos_token: whether ``encode(..., add_special_tokens=True)`` adds them.
        chat_template: the model's Jinja chat template, or None.
        normalizer: applied to text outside the raw added tokens before pre-tokenization.
        ignore_merges, unk_token_id, cache_size: options of the BPE model, :attr:`model` (a
            :class:`~minipaged.tokenizer.bpe.BPE`: the merges, their ranks, the word cache).
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
        self.model = BPE(
            vocab,
            merges,
            ignore_merges=ignore_merges,
            unk_token_id=unk_token_id,
            cache_size=cache_size,
        )
        self._added = AddedTokens(added_tokens)
        self.pre_tokenizer = pre_tokenizer or PreTokenizer([GPT2_PATTERN])
        self.normalizer = normalizer
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template

        # id -> token string and id -> bytes, for decoding. Added tokens are raw text.
        size = max([*self.vocab.values(), *(t.id for t in self._added.tokens)]) + 1
        self._id_to_token: list[str | None] = [None] * size
        self._id_to_bytes: list[bytes] = [b""] * size
        for token, i in self.vocab.items():
            self._id_to_token[i] = token
            self._id_to_bytes[i] = unspell(token)
        for t in self._added.tokens:
            self._id_to_token[t.id] = t.content
            self._id_to_bytes[t.id] = t.content.encode("utf-8")
        for name, token_id in [("bos", bos_token_id), ("eos", eos_token_id), ("pad", pad_token_id)]:
            if token_id is not None and not 0 <= token_id < size:
                raise TokenizerError(f"{name}_token_id {token_id} is outside the vocabulary")

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from a ``.gguf`` file or a folder with ``tokenizer.json`` (+ its config)."""
        return cls(**vars(read_pretrained(path)))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from a GGUF file's ``tokenizer.ggml.*`` metadata (llama.cpp's layout)."""
        return cls(**vars(read_gguf(path)))

    @classmethod
    def from_tokenizer_json(
        cls, path: str | os.PathLike[str], tokenizer_config: dict[str, Any] | None = None
    ) -> Tokenizer:
        """Load from a Hugging Face ``tokenizer.json``; ``tokenizer_config`` is the parsed
        ``tokenizer_config.json`` (optional: chat template, bos/eos/pad tokens)."""
        return cls(**vars(read_tokenizer_json(path, tokenizer_config)))

    # -- the vocabulary -----------------------------------------------------------------------

    @property
    def vocab(self) -> dict[str, int]:
        """Token string (spelled in the byte alphabet) -> id, without the added tokens."""
        return self.model.vocab

    @property
    def added_tokens(self) -> tuple[AddedToken, ...]:
        """The added tokens, by id."""
        return self._added.tokens

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding rows)."""
        return len(self._id_to_token)

    @property
    def unk_token_id(self) -> int | None:
        return self.model.unk_token_id

    @property
    def bos_token(self) -> str | None:
        return self._token_or_none(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token_or_none(self.eos_token_id)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special added tokens (dropped by ``skip_special_tokens``)."""
        return self._added.special_ids

    def token_to_id(self, token: str) -> int | None:
        """The id of an added token's text or a vocabulary string; None if there is none."""
        added = self._added.get(token)
        return self.vocab.get(token) if added is None else added.id

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

    def _token_or_none(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.id_to_token(token_id)

    # -- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Added tokens in the text are always matched whole.

        ``add_special_tokens`` puts bos in front (and eos at the end) only where the model's
        files say so (``add_bos_token``/``add_eos_token``); chat templates add their own.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        ids: list[int] = []
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        for raw_piece, raw_token in self._added.split(text, normalized=False):
            if raw_token is not None:
                ids.append(raw_token.id)
                continue
            piece = self.normalizer(raw_piece) if self.normalizer else raw_piece
            for sub, token in self._added.split(piece, normalized=True):
                if token is not None:
                    ids.append(token.id)
                else:
                    self._encode_ordinary(sub, ids)
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        """Append the ids of text that holds no added token. The hot path: one cache hit/word."""
        word_ids = self.model.word_ids
        for word in self.pre_tokenizer.split(text):
            out.extend(word_ids(word))

    # -- decoding -----------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; bytes that are not valid UTF-8 become U+FFFD.

        Like the `tokenizers` ByteLevel decoder, the text is not cleaned up afterwards
        (``transformers``' ``clean_up_tokenization_spaces`` is not applied), so
        ``decode(encode(s)) == s``.
        """
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """The raw bytes of ``ids`` (what :meth:`decode` turns into text)."""
        special = self.special_token_ids if skip_special_tokens else frozenset()
        return b"".join(self.token_bytes(i) for i in ids if i not in special)

    # -- chat templates -----------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Sequence[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation with the model's own Jinja chat template.

        ``messages`` is a list of ``{"role": ..., "content": ...}`` dicts. With
        ``add_generation_prompt`` the prompt ends with the opening of an assistant turn.
        ``tools`` (JSON schemas) and ``documents`` are passed to templates that use them; extra
        keyword arguments become template variables (as in ``transformers``). Returns the text,
        or its ids (encoded without adding bos: templates write their own) when ``tokenize``.
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise TokenizerError("this tokenizer has no chat template")
        specials = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self._token_or_none(self.pad_token_id),
            "unk_token": self._token_or_none(self.unk_token_id),
        }
        variables = {name: token for name, token in specials.items() if token is not None}
        text = render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            **{**variables, **kwargs},
        )
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.model.merge_ranks)}, "
            f"added={len(self.added_tokens)}, bos={self.bos_token_id}, eos={self.eos_token_id})"
        )


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
        self._chunks.append(new)
        return new

    def finish(self) -> str:
        """End of stream: return held-back bytes of an unfinished character as U+FFFD."""
        rest = self._decoder.decode(b"", final=True)
        self._chunks.append(rest)
        return rest

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)
