"""What weight-only int8 costs in accuracy: perplexity and greedy agreement against float32.

The bundled SmolLM2-135M-Instruct loads twice, float32 and `quantization="int8"` (int8 weights,
a float32 scale per 64 input features, `minipaged.platforms.cpu.quantization`). Both
score the same fixed text (perplexity of each next token, one forward pass over it) and answer
the same chat prompts greedily (`--new-tokens` each): the table gives the perplexities and, per
prompt, how many leading tokens the two answers share, and how many answers are identical.

Run: .venv/bin/python benchmarks/cpu/int8_accuracy.py --threads 1    (~1 minute)
Writes benchmarks/results/int8_accuracy.json.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import torch
import torch.nn.functional as F

from machine import report_header, save_report
from minipaged.engine.llm import LLM
from minipaged.platforms.cpu import cpu_flags
from minipaged.sampling.params import SamplingParams
from minipaged.testing.dense import DenseAttentionBackend, DenseKVCache

RESULTS = Path(__file__).resolve().parents[1] / "results" / "int8_accuracy.json"
TEXT = (
    "The water cycle describes how water moves through the Earth and its atmosphere. Heat "
    "from the sun evaporates water from oceans, lakes and rivers; the vapour rises, cools and "
    "condenses into clouds. When the droplets in a cloud grow heavy enough they fall as rain, "
    "snow or hail. Some of that water flows over the land into streams and back to the sea, "
    "some soaks into the ground and feeds springs and wells, and some is taken up by plants, "
    "which release it again through their leaves. Over thousands of years the same water has "
    "passed through this cycle many times, shaping valleys, carrying soil and sustaining life "
    "in every part of the world."
)
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works.",
    "What are the benefits of drinking water?",
    "Describe the water cycle.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
    "Write a poem about autumn leaves.",
    "How do airplanes stay in the air?",
    "What is the capital of France?",
    "Name three planets of the solar system.",
]


def perplexity(llm: LLM, text: str) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of each token of `text` given the ones before it."""
    ids = llm.tokenizer.encode(text)
    model = llm.engine.runner.model
    attn = DenseAttentionBackend(DenseKVCache(model.config.num_layers), [0], [len(ids)])
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), attn)
        logits = model.compute_logits(hidden[:-1])
    nll = F.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(float(nll)), len(ids)


def answers(llm: LLM, new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, tokens = {}, {}
    for name, quantization in (("float32", None), ("int8", "int8")):
        llm = LLM(dtype="float32", quantization=quantization)
        ppl, n = perplexity(llm, TEXT)
        rows[name] = {"perplexity": round(ppl, 3), "text_tokens": n}
        tokens[name] = answers(llm, args.new_tokens)
        llm.close()
    prefixes = [shared_prefix(a, b) for a, b in zip(tokens["float32"], tokens["int8"],
                                                     strict=True)]
    agree = sum(a == b for ref, q in zip(tokens["float32"], tokens["int8"], strict=True)
                for a, b in zip(ref, q, strict=True))
    table = {
        "perplexity": rows,
        "greedy": {
            "prompts": len(PROMPTS), "new_tokens": args.new_tokens,
            "identical_answers": sum(p == args.new_tokens for p in prefixes),
            "shared_prefix_tokens": prefixes,
            "mean_shared_prefix": round(sum(prefixes) / len(prefixes), 1),
            "same_token_at_same_position": round(agree / (len(PROMPTS) * args.new_tokens), 3),
        },
    }
    print(table)
    flags = cpu_flags()
    save_report(args.out, report_header(avx512f="avx512f" in flags) | table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
