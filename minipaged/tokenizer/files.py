"""Layer 1: reading a tokenizer from its files into one :class:`TokenizerSpec`.

Two sources, both byte-level BPE:

* a **GGUF file**'s ``tokenizer.ggml.*`` metadata (what llama.cpp writes): the tokens, their
  types (control and user-defined tokens are added tokens), the merges, and a pre-tokenizer
  *name* (``tokenizer.ggml.pre``) that maps to a split pattern;
* a **Hugging Face folder**: ``tokenizer.json`` (model, pre-tokenizer, normalizer,
  post-processor, decoder, added tokens) with ``tokenizer_config.json`` (bos/eos/pad tokens,
  ``add_bos_token``, the chat template) or ``chat_template.jinja``. The layouts of SmolLM2,
  LLaMA 3 and Qwen 2/2.5/3 are read; settings minipaged does not implement raise
  :class:`TokenizerError` naming the file and the setting, rather than encoding differently.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regex

from minipaged.tokenizer.added_tokens import AddedToken
from minipaged.tokenizer.bpe import (
    GGUF_PRE_TOKENIZERS,
    GPT2_PATTERN,
    Normalizer,
    PreTokenizer,
    TokenizerError,
    to_byte_alphabet,
)
from minipaged.tokenizer.chat_template import template_from_config
from minipaged.tokenizer.gguf_file import GGUFError, check_types, read_gguf_file


@dataclass
class TokenizerSpec:
    """Everything a tokenizer file says, parsed: the arguments of ``Tokenizer(...)``."""

    vocab: dict[str, int]
    merges: list[tuple[str, str]]
    added_tokens: list[AddedToken]
    pre_tokenizer: PreTokenizer
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None
    normalizer: Normalizer | None = None
    ignore_merges: bool = False
    unk_token_id: int | None = None


# GGUF token types (gguf.TokenType): which vocabulary entries are "added" tokens.
GGUF_TOKEN_NORMAL = 1
GGUF_TOKEN_CONTROL = 3
GGUF_TOKEN_USER_DEFINED = 4


def read_pretrained(path: str | os.PathLike[str]) -> TokenizerSpec:
    """Read a ``.gguf`` file, a ``tokenizer.json``, or a folder with ``tokenizer.json`` (+ its
    config; a folder with no tokenizer.json but one ``.gguf`` file reads that file)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path}: the path does not exist")
    if path.is_dir():
        tokenizer_json = path / "tokenizer.json"
        if not tokenizer_json.is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return read_gguf(ggufs[0])
            raise FileNotFoundError(f"{path} has no tokenizer.json (and not one .gguf file)")
        config_path = path / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        template_path = path / "chat_template.jinja"
        if "chat_template" not in config and template_path.is_file():
            config["chat_template"] = template_path.read_text(encoding="utf-8")
        return read_tokenizer_json(tokenizer_json, config)
    if path.suffix.lower() == ".gguf":
        return read_gguf(path)
    if path.name.endswith(".json"):
        return read_tokenizer_json(path)
    raise TokenizerError(f"{path}: expected a .gguf file, a tokenizer.json or a folder")


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------


def read_gguf(path: str | os.PathLike[str]) -> TokenizerSpec:
    """Read a GGUF file's ``tokenizer.ggml.*`` metadata (llama.cpp's layout)."""
    fields = _read_gguf_tokenizer_fields(path)
    check_types(fields, _GGUF_FIELD_TYPES, str(path), TokenizerError)
    model = fields.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in fields:
        raise TokenizerError(f"{path}: the GGUF file has no tokenizer metadata")
    if model != "gpt2":
        raise TokenizerError(
            f"{path}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported"
        )
    if "tokenizer.ggml.merges" not in fields:
        raise TokenizerError(f"{path}: the GGUF BPE vocabulary has no tokenizer.ggml.merges")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = fields.get("tokenizer.ggml.token_type") or [GGUF_TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerError(f"{path}: {len(tokens)} tokens but {len(types)} entries in token_type")
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for i, (token, token_type) in enumerate(zip(tokens, types, strict=True)):
        # llama.cpp stores control / user-defined tokens as raw text; normal tokens are
        # already spelled in the byte alphabet. Spell any raw one so the vocabulary is
        # uniform (as transformers' GGUF loader does).
        vocab.setdefault(to_byte_alphabet(token), i)
        if token_type in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED):
            added.append(AddedToken(token, i, special=token_type == GGUF_TOKEN_CONTROL))
    merges = [_parse_merge(m, path) for m in fields["tokenizer.ggml.merges"]]
    pre = fields.get("tokenizer.ggml.pre", "default")
    patterns = GGUF_PRE_TOKENIZERS.get(pre)
    if patterns is None:
        warnings.warn(
            f"{path}: unknown pre-tokenizer {pre!r}; using GPT-2's split pattern", stacklevel=3
        )
        patterns = (GPT2_PATTERN,)
    return TokenizerSpec(
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


# The type of each tokenizer field read, as llama.cpp writes it (`check_types`).
_GGUF_FIELD_TYPES = {
    "tokenizer.ggml.model": "string",
    "tokenizer.ggml.pre": "string",
    "tokenizer.chat_template": "string",
    "tokenizer.ggml.tokens": "list of string",
    "tokenizer.ggml.merges": "list of string",
    "tokenizer.ggml.token_type": "list of int",
    "tokenizer.ggml.bos_token_id": "int",
    "tokenizer.ggml.eos_token_id": "int",
    "tokenizer.ggml.padding_token_id": "int",
    "tokenizer.ggml.add_bos_token": "bool",
    "tokenizer.ggml.add_eos_token": "bool",
}


def _read_gguf_tokenizer_fields(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file, as plain Python values."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    try:
        metadata = read_gguf_file(path).metadata
    except GGUFError as e:
        raise TokenizerError(f"{path}: not a readable GGUF file ({e})") from e
    return {name: value for name, value in metadata.items() if name.startswith("tokenizer.")}


# ---------------------------------------------------------------------------------------------
# tokenizer.json + tokenizer_config.json
# ---------------------------------------------------------------------------------------------


def read_tokenizer_json(
    path: str | os.PathLike[str], tokenizer_config: dict[str, Any] | None = None
) -> TokenizerSpec:
    """Read a Hugging Face ``tokenizer.json``.

    ``tokenizer_config`` is the parsed ``tokenizer_config.json`` (optional): it gives the chat
    template and the bos/eos/pad tokens. Its ``add_bos_token``/``add_eos_token``, when present,
    decide which special tokens ``encode(..., add_special_tokens=True)`` adds; otherwise the
    tokenizer.json's post-processor does (LLaMA 3's puts ``<|begin_of_text|>`` first), as in
    ``transformers``.
    """
    data = _read_json(Path(path))
    config = tokenizer_config or {}
    model = data.get("model")
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE" or "merges" not in model:
        kind = model.get("type") if isinstance(model, dict) else model
        raise TokenizerError(f"{path}: the model is {kind!r}; only BPE is supported")
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "byte_fallback", "dropout"):
        if model.get(key):  # "", None, False and 0 are plain byte-level BPE
            raise TokenizerError(f"{path}: BPE with {key}={model[key]!r} is not supported")
    if config.get("split_special_tokens"):
        raise TokenizerError(f"{path}: split_special_tokens=True is not supported")
    vocab: dict[str, int] = model["vocab"]
    added = [_added_token(t, path) for t in data.get("added_tokens") or []]
    by_content = {t.content: t.id for t in added}

    def token_id(token: Any, what: str) -> int | None:
        if isinstance(token, dict):  # an AddedToken written out as a dict
            token = token.get("content")
        if token is None:
            return None
        found = by_content.get(token, vocab.get(token))
        if found is None:
            raise TokenizerError(f"{path}: {what} {token!r} is not in the vocabulary")
        return found

    bos = token_id(config.get("bos_token"), "bos_token")
    eos = token_id(config.get("eos_token"), "eos_token")
    if "add_bos_token" in config or "add_eos_token" in config:
        add_bos = bool(config.get("add_bos_token", False))
        add_eos = bool(config.get("add_eos_token", False))
    else:
        prefix, suffix = _post_processor_specials(data.get("post_processor"), path)
        add_bos, bos = _special_from_template(prefix, bos, "bos_token", path)
        add_eos, eos = _special_from_template(suffix, eos, "eos_token", path)
    _check_decoder(data.get("decoder"), path)
    merges = [
        _parse_merge(m, path) if isinstance(m, str) else (m[0], m[1]) for m in model["merges"]
    ]
    return TokenizerSpec(
        vocab,
        merges,
        added,
        _pre_tokenizer_from_json(data.get("pre_tokenizer"), path),
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=token_id(config.get("pad_token"), "pad_token"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=template_from_config(config.get("chat_template")),
        normalizer=_normalizer_from_json(data.get("normalizer"), path),
        ignore_merges=bool(model.get("ignore_merges", False)),
        unk_token_id=token_id(model.get("unk_token"), "unk_token"),
    )


def _added_token(spec: dict[str, Any], path: Any) -> AddedToken:
    if spec.get("single_word"):
        raise TokenizerError(
            f"{path}: added token {spec.get('content')!r} has single_word=True (not supported)"
        )
    special = spec.get("special", False)
    return AddedToken(
        spec["content"],
        spec["id"],
        special=special,
        lstrip=spec.get("lstrip", False),
        rstrip=spec.get("rstrip", False),
        normalized=spec.get("normalized", not special),
    )


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
            return PreTokenizer(
                patterns,
                add_prefix_space=bool(step.get("add_prefix_space", False)),
                byte_level_split=bool(step.get("use_regex", True)),
            )
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


def _post_processor_specials(spec: dict[str, Any] | None, path: Any) -> tuple[list[int], list[int]]:
    """The special ids a post-processor puts before and after one sequence.

    ByteLevel post-processing only adjusts offsets; TemplateProcessing (``"single":
    "<|begin_of_text|> $A"``) adds tokens. Either may come inside a Sequence.
    """
    prefix: list[int] = []
    suffix: list[int] = []
    steps = [] if spec is None else spec.get("processors", [spec])
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            continue
        if kind != "TemplateProcessing":
            raise TokenizerError(f"{path}: post-processor {kind!r} is not supported")
        specials = step.get("special_tokens", {})
        seen_sequence = False
        for piece in step.get("single", []):
            if "Sequence" in piece:
                seen_sequence = True
            elif "SpecialToken" in piece:
                name = piece["SpecialToken"]["id"]
                if name not in specials:
                    raise TokenizerError(f"{path}: post-processor token {name!r} has no ids")
                (suffix if seen_sequence else prefix).extend(specials[name]["ids"])
    return prefix, suffix


def _special_from_template(
    ids: list[int], named: int | None, name: str, path: Any
) -> tuple[bool, int | None]:
    """(whether to add it, its id) for the one special token a post-processor adds on a side."""
    if not ids:
        return False, named
    if len(ids) > 1 or (named is not None and ids[0] != named):
        raise TokenizerError(
            f"{path}: the post-processor adds ids {ids}, not just the {name} ({named}); "
            "not supported"
        )
    return True, ids[0]


def _check_decoder(spec: dict[str, Any] | None, path: Any) -> None:
    """Decoding is byte-level: each token's bytes, joined (the ByteLevel decoder)."""
    if spec is None:
        return
    steps = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
    kinds = [d.get("type") for d in steps]
    if not kinds or any(kind != "ByteLevel" for kind in kinds):
        raise TokenizerError(f"{path}: decoder {kinds} is not byte-level")


_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}


def _normalizer_from_json(spec: dict[str, Any] | None, path: Any) -> Normalizer | None:
    """Unicode normal forms (alone or in a Sequence) are supported; other normalizers are not."""
    if spec is None:
        return None
    steps = spec["normalizers"] if spec.get("type") == "Sequence" else [spec]
    for step in steps:
        if step.get("type") not in _UNICODE_FORMS:
            raise TokenizerError(f"{path}: normalizer {step.get('type')!r} is not supported")
    return Normalizer(tuple(step["type"] for step in steps)) if steps else None


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
