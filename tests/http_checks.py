"""What the server tests check over HTTP, shared by them: the engine drained (from `/metrics`),
`/health` answering in time while something hostile happens, and a tiny served model folder.

Import as `from http_checks import ...` (`tests/` is on pytest's `pythonpath`).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from minipaged.server.metrics import parse_metrics

# The longest `/health` may take to answer while other clients misbehave.
HEALTH_DEADLINE = 1.0


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics").text)


def drained(values: dict[str, float]) -> bool:
    busy = sum(values[f"minipaged:num_requests_{q}"] for q in ("running", "waiting", "swapped"))
    return busy == 0 and values["minipaged:num_free_blocks"] == values["minipaged:num_blocks"]


def assert_drained(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Wait until `/metrics` shows no request left and every KV block free."""
    deadline = time.monotonic() + timeout
    while not drained(values := metrics(url)):
        assert time.monotonic() < deadline, f"the engine did not drain: {values}"
        time.sleep(0.02)
    return values


def assert_healthy_now(url: str) -> float:
    """`/health` answers 200 within `HEALTH_DEADLINE`; returns how long it took."""
    start = time.monotonic()
    response = httpx.get(url + "/health", timeout=HEALTH_DEADLINE + 1)
    latency = time.monotonic() - start
    assert response.status_code == 200
    assert latency < HEALTH_DEADLINE, f"/health took {latency:.2f} s"
    return latency


class HealthProbe:
    """Polls `/health` on a thread while a `with` block runs; on leaving, asserts every probe
    answered 200 within `HEALTH_DEADLINE`. Entering waits for the first answer, so a block
    that ends at once still leaves a probe to check, and the probes overlap the block."""

    def __init__(self, url: str, interval: float = 0.05) -> None:
        self.url = url
        self.interval = interval
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._done = threading.Event()
        self._first_answer = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=HEALTH_DEADLINE * 5) as client:
            while not self._done.is_set():
                start = time.monotonic()
                try:
                    status = client.get(self.url + "/health").status_code
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                self.latencies.append(time.monotonic() - start)
                self._first_answer.set()
                if status != 200:
                    self.failures.append(f"status {status}")
                self._done.wait(self.interval)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        self._first_answer.wait(HEALTH_DEADLINE * 5)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join(10)
        assert not self.failures, self.failures
        assert self.latencies, "no probe answered"
        slowest = max(self.latencies)
        assert slowest < HEALTH_DEADLINE, f"/health took up to {slowest:.2f} s"


def save_tiny_model_folder(folder: Path, max_position_embeddings: int = 4096) -> Path:
    """A Hugging Face folder `minipaged serve --model` loads: a two-layer random LLaMA and a
    byte-level BPE tokenizer trained here (300 tokens, EOS `</s>`)."""
    import tokenizers
    from tiny_models import SMALL_LLAMA, random_llama

    tk = tokenizers.Tokenizer(tokenizers.models.BPE())
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog. "] * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    config = SMALL_LLAMA | dict(
        vocab_size=tk.get_vocab_size(), max_position_embeddings=max_position_embeddings
    )
    random_llama(**config).save_pretrained(folder)
    return folder
