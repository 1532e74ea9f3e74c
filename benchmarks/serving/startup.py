"""Start-up: from a fresh Python process to an engine ready for its first request.

Each start runs in a new process (what a user of `minipaged chat` or `serve` waits for: the
imports, the checkpoint, the tokenizer, the KV cache, the GEMM probe), timed from the process's
first line to `LLM()` returned, with its peak resident memory. The peer is transformers' own
start on the same file: `AutoModelForCausalLM.from_pretrained(gguf_file=...)` and its tokenizer.
Starts alternate between the two, `--repeats` of each; the table gives medians.

In one process, the parts of reading the GGUF file, each next to the `gguf` package's way:
the header (`gguf_file.read_gguf_file` against `gguf.GGUFReader`) and the dequantisation of
every tensor (`checkpoint_gguf.dequantize_rows` against `gguf.quants.dequantize`), with the
values checked equal.

Run: .venv/bin/python benchmarks/serving/startup.py   (~2 minutes)
Writes benchmarks/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import gguf
import numpy as np

from machine import report_header, save_report
from minipaged.models.checkpoint.gguf_weights import dequantize_rows
from minipaged.models.checkpoint.loader import default_model_path
from minipaged.tokenizer.gguf_file import read_gguf_file

RESULTS = Path(__file__).resolve().parents[1] / "results" / "startup.json"
# Each start prints one JSON line: seconds from its first line to the engine (model) ready, and
# its peak resident memory.
STARTS = {
    "minipaged LLM()": """
from minipaged import LLM
engine = LLM({path!r})
""",
    "transformers model + tokenizer": """
import transformers
folder, name = {folder!r}, {name!r}
model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
""",
}
PROLOGUE = "import time\nbegan = time.perf_counter()\n"
EPILOGUE = """
import json, resource
print(json.dumps({"seconds": time.perf_counter() - began,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def start_once(body: str, threads: int) -> dict[str, float]:
    """One start in a new process: its seconds to ready and peak resident memory."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TQDM_DISABLE="1",
               TRANSFORMERS_VERBOSITY="error")
    run = subprocess.run([sys.executable, "-c", PROLOGUE + body + EPILOGUE],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(run.stdout.strip().splitlines()[-1])


def median_s(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    path = default_model_path()
    report = report_header() | {"model": path.name, "threads": args.threads}

    parts = {}
    ours = read_gguf_file(path)
    parts["GGUF header"] = {
        "minipaged s": median_s(lambda: read_gguf_file(path), args.repeats),
        "gguf package s": median_s(lambda: gguf.GGUFReader(path), args.repeats),
    }
    tensors = ours.tensors
    for t in tensors:  # the same values either way
        assert np.array_equal(dequantize_rows(t.data, t.tensor_type),
                              gguf.quants.dequantize(t.data, t.tensor_type)), t.name
    parts["dequantise every tensor"] = {
        "minipaged s": median_s(
            lambda: [dequantize_rows(t.data, t.tensor_type) for t in tensors], args.repeats),
        "gguf package s": median_s(
            lambda: [gguf.quants.dequantize(t.data, t.tensor_type) for t in tensors],
            args.repeats),
    }

    substitutions = dict(path=str(path), folder=str(path.parent), name=path.name)
    starts: dict[str, list[dict[str, float]]] = {name: [] for name in STARTS}
    for _ in range(args.repeats):  # alternating, so that both see the same machine
        for name, body in STARTS.items():
            starts[name].append(start_once(body.format(**substitutions), args.threads))
    report["parts"] = parts
    report["starts"] = {
        name: {
            "seconds": [round(r["seconds"], 3) for r in runs],
            "median_s": round(statistics.median(r["seconds"] for r in runs), 3),
            "peak_rss_mib": round(statistics.median(r["peak_rss_mib"] for r in runs)),
        }
        for name, runs in starts.items()
    }

    print(f"{'part (one process)':<28}{'minipaged s':>13}{'gguf pkg s':>12}{'ratio':>8}")
    for name, row in parts.items():
        ratio = row["gguf package s"] / row["minipaged s"]
        print(f"{name:<28}{row['minipaged s']:>13.3f}{row['gguf package s']:>12.3f}"
              f"{ratio:>7.1f}x")
    print(f"\n{'start (fresh process)':<34}{'median s':>10}{'peak RSS MiB':>14}")
    for name, row in report["starts"].items():
        print(f"{name:<34}{row['median_s']:>10.2f}{row['peak_rss_mib']:>14}")
    save_report(RESULTS, report)
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
