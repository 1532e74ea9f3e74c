"""Tensor-parallel workers do not depend on the caller's main module.

Rank 0 starts each worker as `python -m minipaged.runner.parallel FD`, so the program that creates
`LLM(..., tensor_parallel_size=2)` may be anything Python runs: a script read from standard
input, a script without an `if __name__ == "__main__":` guard, `python -c`, a notebook. Each
test runs one such program as a real subprocess (gloo on the CPU) on a tiny model with a tiny
byte-level BPE tokenizer, and checks its greedy tokens against TP=1 in this process and that
its workers are gone once it closes the engine or exits. A worker that dies while loading ends
the start-up with `WorkerDiedError` naming the rank.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tiny_models import SMALL_LLAMA, random_llama

from minipaged.engine.llm import LLM
from minipaged.runner.parallel.runner import WorkerDiedError
from minipaged.sampling.params import SamplingParams

pytestmark = pytest.mark.xdist_group("tensor_parallel")

PROMPTS = ["the quick brown fox", "paged attention", "a"]
SETTINGS = dict(device="cpu", block_size=4, num_gpu_blocks=32, num_cpu_blocks=0)
RUN_TIMEOUT_S = 180


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def save_tiny_model(folder: Path) -> None:
    """A byte-level BPE tokenizer trained on a few words and a random two-layer GQA LLaMA
    whose vocabulary is exactly the tokenizer's (an odd size: the ranks' halves are padded)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(PROMPTS * 10, trainer)
    tk.save(str(folder / "tokenizer.json"))
    random_llama(**(SMALL_LLAMA | dict(vocab_size=tk.get_vocab_size()))).save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """The tiny model's folder and TP=1's greedy tokens for `PROMPTS`."""
    folder = tmp_path_factory.mktemp("tiny-tp")
    save_tiny_model(folder)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(folder), **SETTINGS) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(PROMPTS)
    return folder, [o.outputs[0].token_ids for o in outputs]


def program(folder: Path, close: bool = True) -> str:
    """Python source that runs TP=2 on `folder` and prints its tokens and worker pids, at top
    level (no `__main__` guard); with `close`, closes the engine and prints whether each
    worker is gone."""
    source = f"""
        import json, os
        from minipaged.engine.llm import LLM
        from minipaged.sampling.params import SamplingParams

        llm = LLM({str(folder)!r}, tensor_parallel_size=2, tensor_parallel_timeout=30,
                  **{SETTINGS!r})
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        outputs = llm.generate({PROMPTS!r}, params, use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "length" for o in outputs), outputs
        print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outputs]))
        pids = llm.engine.runner.worker_pids
        print("WORKERS", json.dumps(pids), flush=True)
    """
    if close:
        source += """
        llm.close()
        print("GONE", json.dumps([not os.path.exists(f"/proc/{pid}") for pid in pids]))
        """
    return textwrap.dedent(source)


def printed(stdout: str, tag: str) -> list:
    """The JSON printed after `tag` on the one line that starts with it."""
    lines = [line for line in stdout.splitlines() if line.startswith(tag + " ")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0].removeprefix(tag + " "))


def run_python(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S, **kwargs)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_a_script_from_standard_input(tiny):
    """`python - <<EOF`: spawn's re-import failed here with FileNotFoundError '<stdin>'."""
    folder, expected = tiny
    run = run_python(["-"], input=program(folder))
    assert printed(run.stdout, "TOKENS") == expected
    assert printed(run.stdout, "GONE") == [True]  # close() stopped and reaped the worker


def test_python_c(tiny):
    folder, expected = tiny
    run = run_python(["-c", program(folder)])
    assert printed(run.stdout, "TOKENS") == expected
    assert printed(run.stdout, "GONE") == [True]


def test_a_script_without_a_main_guard_runs_once(tiny, tmp_path):
    """A script at top level, never closing its engine: it runs once (a spawned worker ran it
    again, and printed its own TOKENS line or failed), and the interpreter's exit stops the
    worker."""
    folder, expected = tiny
    script = tmp_path / "unguarded.py"
    script.write_text(program(folder, close=False))
    run = run_python([str(script)])
    assert printed(run.stdout, "TOKENS") == expected  # exactly one line: it ran once
    assert not any(running(pid) for pid in printed(run.stdout, "WORKERS"))


def test_a_notebook(tiny):
    """Two cells run by a Jupyter kernel (nbclient): the engine in the first, the check and
    close in the second, as a user would."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    folder, expected = tiny
    first, _, second = program(folder).partition("llm.close()")
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(first), nbformat.v4.new_code_cell("llm.close()" + second),
    ])
    nbclient.NotebookClient(notebook, timeout=RUN_TIMEOUT_S, kernel_name="python3").execute()
    stdout = "".join(output.get("text", "") for cell in notebook.cells
                     for output in cell.outputs if output.output_type == "stream")
    assert printed(stdout, "TOKENS") == expected
    assert printed(stdout, "GONE") == [True]


DYING_SOURCE = """
import os
from minipaged.runner.parallel.worker import CheckpointShards


class DyingShards(CheckpointShards):
    \"\"\"Rank 0 loads; every other rank's process exits at once, as a crash would.\"\"\"

    def load(self, tp, dtype, device):
        if tp.rank != 0:
            os._exit(3)
        return super().load(tp, dtype, device)
"""


def test_a_worker_that_dies_while_loading_is_named(tiny, tmp_path, monkeypatch):
    """The worker imports the caller's own `ShardSource` from the caller's import path (a
    folder only this process has on `sys.path`), then exits while loading: the start-up ends
    with `WorkerDiedError` naming rank 1 and its exit code, and nothing is left running."""
    from minipaged.engine.config import EngineConfig
    from minipaged.engine.engine import LLMEngine
    from minipaged.models.tensor_parallel import SINGLE_RANK

    folder, _ = tiny
    (tmp_path / "dying_shards.py").write_text(DYING_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from dying_shards import DyingShards

    config = EngineConfig(**SETTINGS, tensor_parallel_size=2, tensor_parallel_timeout=30)
    source = DyingShards(str(folder))
    model_config = source.load(SINGLE_RANK, torch.float32, torch.device("cpu"))[1]
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) exited with code 3 "
                                              "while loading") as died:
        LLMEngine(source, model_config, None, config)
    assert not dist.is_initialized()
    pid = int(re.search(r"pid (\d+)", str(died.value)).group(1))
    assert not os.path.exists(f"/proc/{pid}")  # reaped, not left a zombie


def test_a_rank_keeps_the_tables_rank_0_did_not_change():
    """Plans arrive pickled, every table a new object: a table equal to its sequence's in the
    last plan becomes that very object again (the runner's rows are kept by identity), a
    changed one stays new, and a sequence that left is forgotten."""
    from minipaged.runner.flat_batch import BlockTables
    from minipaged.runner.parallel.worker import same_tables
    from minipaged.sched.output import ScheduledSequence, SchedulerOutput

    def plan(**tables):
        return pickle.loads(pickle.dumps(SchedulerOutput(scheduled=[
            ScheduledSequence("r", int(seq[1:]), 0, (1,), block_table=table)
            for seq, table in tables.items()])))

    kept: dict = {}
    rows = BlockTables(num_blocks=16)
    first = same_tables(plan(s1=(3, 4), s2=(5,)), kept)
    for entry in first.scheduled:
        rows.row(entry.block_table)
    second = same_tables(plan(s1=(3, 4), s2=(5, 6)), kept)
    assert second.scheduled[0].block_table is first.scheduled[0].block_table
    assert second.scheduled[1].block_table is not first.scheduled[1].block_table
    assert id(second.scheduled[0].block_table) in rows.rows  # no row written again
    third = same_tables(plan(s2=(5, 6)), kept)
    assert third.scheduled[0].block_table is second.scheduled[1].block_table
    assert list(kept) == [2]
