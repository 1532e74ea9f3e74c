"""The engine on a GPU against its references, in one run: greedy tokens equal to transformers'
in float32, replayed decode steps (CUDA graphs) equal to the eager modules', and the KV cache
sized after the weights.

    python benchmarks/gpu/correctness.py            # on a CUDA machine
    python benchmarks/gpu/correctness.py --smoke    # on a CPU: tiny shapes, the CPU platform

1. **Greedy float32 tokens** of `minipaged.LLM` (default settings: Triton attention, CUDA graphs
   for decode steps) and of transformers' `generate` on the same random LLaMA-shaped model, for
   16 prompts of random ids: how many of the 16 agree token for token.
2. **Replay equals eager**: the same engine with `enforce_eager=True` in bfloat16 (a replay runs
   the very kernels the modules launch, so the tokens must agree exactly).
3. **Memory**: the number of KV blocks the runner sized from the memory left after the weights
   and a profile step, with the card's total and the weights' bytes.

Returns a dict (`main` prints it and writes it into `--out`, a JSON file) and exits non-zero when
a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu.random_models import TINY_LLAMA, build_hf, save_folder  # noqa: E402

SMALL_LLAMA = dict(model_type="llama", vocab_size=4096, hidden_size=512, intermediate_size=1408,
                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                   max_position_embeddings=2048, tie_word_embeddings=False)


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(8, 64))] for _ in range(count)]


def transformers_greedy(model, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone (no padding to get wrong)."""
    out = []
    device = next(model.parameters()).device
    for ids in batch:
        with torch.inference_mode():
            generated = model.generate(torch.tensor([ids], device=device), do_sample=False,
                                       max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                       pad_token_id=0, eos_token_id=None)
        out.append(generated[0, len(ids):].tolist())
    return out


def minipaged_greedy(folder: Path, batch: list[list[int]], max_tokens: int, **options):
    from minipaged import LLM, SamplingParams

    llm = LLM(model=str(folder), **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(batch, params, use_tqdm=False)
    runner = llm.engine.runner
    info = {"num_gpu_blocks": runner.num_gpu_blocks, "platform": runner.platform.name,
            "graph_sizes": len(runner.platform.graph_sizes)}
    return [list(o.outputs[0].token_ids) for o in outputs], info


def run(device: str, config: dict, count: int, max_tokens: int) -> dict:
    result: dict = {"device": device}
    batch = prompts(count, config["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_hf(config, device, torch.float32)
        folder = save_folder(hf, Path(tmp) / "model")
        start = time.perf_counter()
        theirs = transformers_greedy(hf, batch, max_tokens)
        result["transformers_s"] = time.perf_counter() - start
        del hf
        ours, info = minipaged_greedy(folder, batch, max_tokens, device=device, dtype="float32")
        result |= {"float32_" + k: v for k, v in info.items()}
        result["greedy_equal"] = sum(a == b for a, b in zip(ours, theirs, strict=True))
        result["greedy_total"] = count
        graphs, _ = minipaged_greedy(folder, batch, max_tokens, device=device, dtype="bfloat16")
        eager, _ = minipaged_greedy(folder, batch, max_tokens, device=device, dtype="bfloat16",
                                    enforce_eager=True)
        result["replay_equals_eager"] = sum(a == b for a, b in zip(graphs, eager, strict=True))
    if device == "cuda":
        result["card"] = torch.cuda.get_device_name()
        result["card_bytes"] = torch.cuda.get_device_properties(0).total_memory
    result["ok"] = (result["greedy_equal"] == count and result["replay_equals_eager"] == count)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        result = run("cpu", TINY_LLAMA, count=4, max_tokens=8)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device", file=sys.stderr)
            return 2
        result = run("cuda", SMALL_LLAMA, count=16, max_tokens=32)
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
