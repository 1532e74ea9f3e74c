"""llama.cpp's side of `llamacpp.py`: one GGUF model served greedily through its C API.

Run by `llamacpp.py` as a child process, with a Python that has `llama-cpp-python` (an
optional benchmark dependency, not minipaged's; see `llamacpp.py` for the install), so it
imports neither torch nor minipaged. It speaks JSON lines:

* started as `python worker.py MODEL.gguf --format f32|native --threads N`, it loads
  the model (`f32`: first requantised to F32 with `llama_model_quantize`, `allow_requantize`, into
  a temporary folder) and prints `{"ready": true, ...}` with the model's size and llama.cpp's
  system info (the CPU features ggml was built for);
* each line `{"requests": [[prompt_ids, output_len], ...]}` on standard input is run to
  completion in a fresh context and answered with `{"seconds": s, "tokens": [[...], ...],
  "decode_step_s": [...]}`; end of input ends the process.

Serving is llama-server's continuous batching on the C API: one context holds every sequence
(`n_seq_max` = the number of requests, `kv_unified`, `n_ctx` = all their tokens), and each
`llama_decode` call takes one new token of every sequence that is generating plus prompt tokens
of the next waiting ones, up to `n_batch` (2048, llama.cpp's default) in all. Greedy: the next
token is the argmax of the row's logits; each request generates exactly `output_len` tokens (no
end-of-sequence stop, like `ignore_eos`). The K/V cache is llama.cpp's default type (F16).
Weights stay in llama.cpp's plain CPU buffers unless `--extra-buffers`: on a CPU with AMX its
AMX buffer type repacks the Q4_1 weights, and `llama_decode` then crashed (SIGSEGV) here
(llama-cpp-python 0.3.36, 2026-12-01); without it Q4_1 runs on its AVX-512 kernels.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

N_BATCH = 2048  # tokens per llama_decode call: llama.cpp's default, minipaged's step budget


@dataclass
class Sequence:
    """One request in flight: its prompt, how far the prompt is fed, what it generated."""

    seq_id: int
    prompt: list[int]
    output_len: int
    fed: int = 0
    tokens: list[int] = field(default_factory=list)

    @property
    def generating(self) -> bool:
        return self.fed == len(self.prompt) and 0 < len(self.tokens) < self.output_len

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.output_len


def requantised_f32(llama_cpp, source: Path, folder: Path, threads: int) -> Path:
    """`source` requantised to an all-F32 GGUF in `folder` (`llama_model_quantize`)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = threads
    target = folder / (source.stem + ".F32.gguf")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(),
                                      ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {source}")
    return target


class Peer:
    """A loaded llama.cpp model and the settings of the contexts it serves from."""

    def __init__(self, llama_cpp, path: Path, threads: int, extra_buffers: bool = False):
        self.llama_cpp, self.threads = llama_cpp, threads
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = extra_buffers
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def context(self, n_ctx: int, n_seq: int):
        """A fresh context for `n_seq` sequences of `n_ctx` tokens in all."""
        params = self.llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = N_BATCH
        params.n_seq_max = n_seq
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = self.threads
        ctx = self.llama_cpp.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} tokens")
        return ctx

    def run(self, requests: list[tuple[list[int], int]]) -> dict[str, object]:
        """Every request to completion in one fresh context; seconds, tokens, decode steps."""
        lc = self.llama_cpp
        seqs = [Sequence(i, list(p), n) for i, (p, n) in enumerate(requests)]
        n_ctx = -(-sum(len(s.prompt) + s.output_len for s in seqs) // 256) * 256 + 256
        ctx = self.context(n_ctx, len(seqs))
        batch = lc.llama_batch_init(N_BATCH, 0, 1)
        decode_steps: list[float] = []
        try:
            start = time.perf_counter()
            while not all(s.done for s in seqs):
                rows = self._fill(batch, seqs)
                begin = time.perf_counter()
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                if all(not is_prompt for _, is_prompt in rows):
                    decode_steps.append(time.perf_counter() - begin)
                for i, (seq, _) in enumerate(rows):
                    if seq is not None:
                        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i),
                                                       shape=(self.n_vocab,))
                        seq.tokens.append(int(logits.argmax()))
            seconds = time.perf_counter() - start
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        return {"seconds": seconds, "tokens": [s.tokens for s in seqs],
                "decode_step_s": decode_steps}

    @staticmethod
    def _fill(batch, seqs: list[Sequence]) -> list[tuple[Sequence | None, bool]]:
        """Put one token of every generating sequence, then prompt tokens of the others, into
        `batch`; for each row, the sequence its logits extend (None: no logits) and whether it
        is a prompt token."""
        rows: list[tuple[Sequence | None, bool]] = []

        def add(seq: Sequence, token: int, pos: int, logits: bool, is_prompt: bool) -> None:
            i = len(rows)
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq.seq_id, logits
            rows.append((seq if logits else None, is_prompt))

        for seq in seqs:
            if seq.generating:
                add(seq, seq.tokens[-1], len(seq.prompt) + len(seq.tokens) - 1, True, False)
        for seq in seqs:
            while seq.fed < len(seq.prompt) and len(rows) < N_BATCH:
                seq.fed += 1
                add(seq, seq.prompt[seq.fed - 1], seq.fed - 1, seq.fed == len(seq.prompt), True)
        batch.n_tokens = len(rows)
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--format", choices=["f32", "native"], default="native")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--extra-buffers", action="store_true",
                        help="let llama.cpp repack weights into its extra buffer types (AMX)")
    args = parser.parse_args()
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    llama_cpp.llama_backend_init()
    with tempfile.TemporaryDirectory() as folder:
        path = (requantised_f32(llama_cpp, args.model, Path(folder), args.threads)
                if args.format == "f32" else args.model)
        peer = Peer(llama_cpp, path, args.threads, args.extra_buffers)
        peer.run([(list(range(17, 25)), 2)])  # warm-up: first calls, buffers
        print(json.dumps({
            "ready": True, "format": args.format,
            "extra_buffers": args.extra_buffers, "model_bytes": int(
                llama_cpp.llama_model_size(peer.model)),
            "llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(),
        }), flush=True)
        for line in sys.stdin:
            job = json.loads(line)
            print(json.dumps(peer.run([(p, n) for p, n in job["requests"]])), flush=True)


if __name__ == "__main__":
    main()
