"""The command line: `minipaged generate`, `minipaged chat` (one-shot or interactive).

Flags mirror `SamplingParams` and the `LLM` constructor, so the shell and Python read alike. The
choices of `--scheduler`, `--dtype` and `--attention-backend` are read from the engine's own
registries, so a scheduler registered in `minipaged.engine.SCHEDULERS` is selectable here too.

Exit status: 0 on success, 2 on bad input (argparse's usage errors and any `ValueError` the
engine raises, e.g. an out-of-range sampling parameter, printed without a traceback), 130 when
interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from minipaged.server.cli import add_serve_parser, run_serve

SAMPLING_FLAGS: dict[str, tuple[type, str]] = {
    "n": (int, "number of completions per prompt"),
    "temperature": (float, "0 for greedy decoding (the default here)"),
    "top_k": (int, "keep the k most likely tokens (0 or -1: all)"),
    "top_p": (float, "nucleus sampling mass"),
    "min_p": (float, "drop tokens below min_p x the top probability"),
    "seed": (int, "seed of this request's random generator"),
    "max_tokens": (int, "maximum number of generated tokens"),
    "min_tokens": (int, "minimum number of generated tokens before a stop is honoured"),
    "presence_penalty": (float, "penalty for tokens already generated"),
    "frequency_penalty": (float, "penalty growing with a generated token's count"),
    "repetition_penalty": (float, "penalty for tokens seen in prompt or output (1: off)"),
    "logprobs": (int, "number of top log-probabilities to return per token"),
    "beam_width": (int, "beam search with this many beams"),
    "length_penalty": (float, "beam search length penalty"),
}

# Defaults that differ from SamplingParams': the command line answers greedily, and at length.
GENERATE_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}
CHAT_DEFAULTS = {"temperature": 0.0, "max_tokens": 256}


# -- the parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minipaged", description="Serve an LLM with PagedAttention, from scratch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    generate = sub.add_parser("generate", help="complete raw text prompts")
    generate.add_argument("prompts", nargs="+", help="one or more prompts, batched together")
    chat = sub.add_parser("chat", help="chat with the model (interactive without a message)")
    chat.add_argument("message", nargs="?", help="a single user message; omit for a chat session")
    chat.add_argument("--system", help="a system prompt")
    for command in (generate, chat):
        _add_engine_flags(command)
        _add_sampling_flags(command)
    add_serve_parser(sub, _add_engine_flags)
    return parser


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    from minipaged.attention import BACKENDS
    from minipaged.engine import DTYPES, SCHEDULERS

    engine = parser.add_argument_group("engine (see EngineConfig)")
    engine.add_argument("--model", help="HF folder or .gguf file (default: bundled SmolLM2)")
    engine.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    engine.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    engine.add_argument("--num-gpu-blocks", type=int, default=None,
                        help="KV blocks on the device (default: from the memory budget)")
    engine.add_argument("--swap-space", type=float, default=1.0,
                        help="GiB of host memory for swapped-out blocks")
    engine.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens computed per step")
    engine.add_argument("--scheduler", default="fcfs", choices=sorted(SCHEDULERS))
    engine.add_argument("--preemption-mode", default=None, choices=["recompute", "swap"])
    engine.add_argument("--attention-backend", default=None, choices=list(BACKENDS),
                        help="default: triton on CUDA, torch elsewhere")
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice); 1 is often faster "
                             "on a CPU shared with other work")


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    sampling = parser.add_argument_group("sampling (see SamplingParams)")
    for name, (kind, text) in SAMPLING_FLAGS.items():
        sampling.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    sampling.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", default=None)


# -- from flags to objects ------------------------------------------------------------------------


def sampling_params_from_args(args: argparse.Namespace, **defaults: Any):
    """The `SamplingParams` the flags ask for; unset flags take `defaults`, then vLLM's."""
    from minipaged.sampling import SamplingParams

    values = dict(defaults)
    for name in [*SAMPLING_FLAGS, "stop", "ignore_eos"]:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if "beam_width" in values:
        values["use_beam_search"] = True
    return SamplingParams(**values)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM(...)` keyword arguments the flags ask for."""
    return dict(
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        swap_space=args.swap_space,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduler=args.scheduler,
        preemption_mode=args.preemption_mode,
        attention_backend=args.attention_backend,
        enable_prefix_caching=not args.no_prefix_caching,
    )


def llm_from_args(args: argparse.Namespace):
    import torch

    from minipaged.engine import LLM

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    return LLM(model=args.model, **engine_kwargs_from_args(args))


# -- the commands ---------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> None:
    params = sampling_params_from_args(args, **GENERATE_DEFAULTS)  # bad values fail before loading
    llm = llm_from_args(args)
    for output in llm.generate(args.prompts, params, use_tqdm=False):
        for completion in output.outputs:
            tag = f"[{completion.index}] " if len(output.outputs) > 1 else ""
            print(f"{tag}{output.prompt}{completion.text}")


def run_chat(args: argparse.Namespace) -> None:
    params = sampling_params_from_args(args, **CHAT_DEFAULTS)
    llm = llm_from_args(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    if args.message is not None:
        messages.append({"role": "user", "content": args.message})
        outputs = llm.chat(messages, params, use_tqdm=False)[0].outputs
        for completion in outputs:
            tag = f"[{completion.index}] " if len(outputs) > 1 else ""
            print(f"{tag}{completion.text}")
        return
    chat_session(llm, messages, params)


def run_serve_command(args: argparse.Namespace) -> None:
    run_serve(args, lambda: llm_from_args(args).engine)


def chat_session(llm: Any, messages: list[dict[str, str]], params: Any) -> None:
    """Read a line, stream the answer as it is generated, repeat; an empty line or EOF ends."""
    print("minipaged chat: an empty line or Ctrl-D ends the session.")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        print("bot> ", end="", flush=True)
        answer = ""
        for piece in llm.chat_stream(messages, params):
            answer += piece
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": answer})


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (argparse's usage errors included)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed by argparse
        return exc.code if isinstance(exc.code, int) else 2
    try:
        commands = {"generate": run_generate, "chat": run_chat, "serve": run_serve_command}
        commands[args.command](args)
    except ValueError as exc:  # bad input: say what is wrong, without a traceback
        print(f"minipaged: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
