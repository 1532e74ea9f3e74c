"""The command line: `minipaged generate`, `minipaged chat` (one-shot or interactive), `serve`.

Flags mirror `SamplingParams` and the `LLM` constructor, so the shell and Python read alike. The
choices of `--scheduler`, `--dtype` and `--attention-backend` are read from the engine's own
registries, so a scheduler registered in `minipaged.sched.registry.SCHEDULERS` is
selectable here too.

`generate` decodes greedily. `chat` samples: each setting comes from a flag if given, else from
the model's own `generation_config.json` (Hugging Face's file, in the model's folder or next to
its GGUF file), else from `CHAT_DEFAULTS`; `--temperature 0` makes it greedy. The interactive chat
edits lines with `readline` on a terminal, takes `/help`, `/reset` and `/exit`, and Ctrl-C stops
the answer being generated (its request is aborted) without ending the conversation.

Exit status: 0 on success, 2 on bad input (argparse's usage errors and any `ValueError` the
engine raises, e.g. an out-of-range sampling parameter, printed without a traceback), 130 when
interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

from minipaged.server.serve_command import add_serve_parser, run_serve

SAMPLING_FLAGS: dict[str, tuple[type, str]] = {
    "n": (int, "number of completions per prompt"),
    "temperature": (float, "0 for greedy decoding (generate's default)"),
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

# Defaults that differ from SamplingParams'. `generate` completes text greedily. `chat` samples
# where the model's generation_config.json says nothing: greedy decoding makes the bundled
# SmolLM2 repeat itself ("a page of pages, a page of pages, ..."); temperature 0.7 and top-p 0.9
# with a mild repetition penalty keep its answers varied, and the fixed seed reproducible.
GENERATE_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}
CHAT_DEFAULTS = {
    "temperature": 0.7,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
    "seed": 0,
    "max_tokens": 256,
}
# The keys of Hugging Face's generation_config.json that chat reads, and their SamplingParams names.
GENERATION_CONFIG_KEYS = {
    **{name: name for name in ("temperature", "top_p", "top_k", "repetition_penalty")},
    "max_new_tokens": "max_tokens",
}

# An answer's text, piece by piece; closing it stops the answer.
TextStream = Generator[str, None, None]

CHAT_HELP = """\
commands (never sent to the model):
  /help    this list
  /reset   start a new conversation (the --system prompt stays)
  /exit    end the session (Ctrl-D too)
Ctrl-C stops the answer being generated; the conversation before it goes on."""


# -- the parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minipaged", description="Serve an LLM with PagedAttention, from scratch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    generate = sub.add_parser("generate", help="complete raw text prompts")
    generate.add_argument("prompts", nargs="+", help="one or more prompts, batched together")
    chat = sub.add_parser(
        "chat",
        help="chat with the model (interactive without a message)",
        description="Answer one message, or chat (without one). Each sampling setting comes "
        "from its flag, else the model's generation_config.json, else: "
        + ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in CHAT_DEFAULTS.items())
        + ". --temperature 0 decodes greedily.",
    )
    chat.add_argument("message", nargs="?", help="a single user message; omit for a chat session")
    chat.add_argument("--system", help="a system prompt")
    for command in (generate, chat):
        _add_engine_flags(command)
        _add_sampling_flags(command)
    add_serve_parser(sub, _add_engine_flags)
    return parser


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    from minipaged.engine.config import DTYPE_CHOICES, EngineConfig
    from minipaged.platforms import BACKENDS, QUANTIZATIONS
    from minipaged.sched.output import PreemptionMode
    from minipaged.sched.registry import SCHEDULERS

    # Every default is EngineConfig's own: one source for Python and the shell.
    defaults = {field.name: field.default for field in dataclasses.fields(EngineConfig)}
    engine = parser.add_argument_group("engine (see EngineConfig)")

    def flag(name: str, **options: Any) -> None:
        engine.add_argument("--" + name.replace("_", "-"), default=defaults[name], **options)

    engine.add_argument("--model", help="HF folder or .gguf file (default: bundled SmolLM2)")
    flag("dtype", choices=sorted(DTYPE_CHOICES))
    flag("device", help="cpu or cuda (default: cuda if available)")
    flag("block_size", type=int, help="tokens per KV block")
    flag("num_gpu_blocks", type=int, help="KV blocks on the device (default: from the memory "
         "budget)")
    flag("swap_space", type=float, help="GiB of host memory for swapped-out blocks")
    flag("max_num_seqs", type=int, help="sequences per step")
    flag("max_num_batched_tokens", type=int, help="tokens computed per step")
    flag("scheduler", choices=sorted(SCHEDULERS))
    flag("preemption_mode", choices=[mode.value for mode in PreemptionMode])
    flag("long_prefill_token_threshold", type=int,
         help="most tokens of one prompt per step, so that others are not held up behind it "
              "(0: no limit)")
    flag("attention_backend", choices=list(BACKENDS),
         help="default: triton on CUDA, cpu on a CPU, torch elsewhere")
    flag("quantization", choices=list(QUANTIZATIONS),
         help="weight-only int8 weights, quantised at load (CPU)")
    engine.add_argument("--no-prefix-caching", action="store_true")  # EngineConfig's default: on
    engine.add_argument("--enforce-eager", action="store_true",
                        help="run every step through the model's modules (no replayed decode "
                             "steps on a CPU)")
    flag("tensor_parallel_size", type=int,
         help="split the model over N worker processes (torch.distributed)")
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
    from minipaged.sampling.params import SamplingParams

    flags = {name: getattr(args, name) for name in [*SAMPLING_FLAGS, "stop", "ignore_eos"]}
    values = {**defaults, **{name: value for name, value in flags.items() if value is not None}}
    if "beam_width" in values:
        values["use_beam_search"] = True
    return SamplingParams(**values)


def model_generation_settings(model: str | Path | None) -> dict[str, Any]:
    """The sampling settings in a model's `generation_config.json`, as `SamplingParams` fields.

    The file sits in the model's folder (or the folder of its GGUF file); {} when there is none.
    Only the settings it states are returned; `do_sample: false` means greedy (temperature 0), as
    in `transformers`. A file that is not a JSON object raises `ValueError` naming it.
    """
    from minipaged.models.checkpoint.loader import default_model_path

    path = default_model_path() if model is None else Path(model)
    file = (path if path.is_dir() else path.parent) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    stated = {key: value for key, value in config.items() if value is not None}
    settings = {name: stated[key] for key, name in GENERATION_CONFIG_KEYS.items() if key in stated}
    if config.get("do_sample") is False:
        settings["temperature"] = 0.0
    return settings


def chat_sampling_params(args: argparse.Namespace):
    """Chat's `SamplingParams`: the flags, then the model's generation settings, then ours."""
    return sampling_params_from_args(
        args, **{**CHAT_DEFAULTS, **model_generation_settings(args.model)}
    )


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM(...)` keyword arguments the flags ask for: each flag named like an
    `EngineConfig` field (but --seed, the request's), and --no-prefix-caching."""
    from minipaged.engine.config import EngineConfig

    names = {field.name for field in dataclasses.fields(EngineConfig)} - set(SAMPLING_FLAGS)
    kwargs = {name: value for name, value in vars(args).items() if name in names}
    kwargs["enable_prefix_caching"] = not args.no_prefix_caching
    return kwargs


def llm_from_args(args: argparse.Namespace):
    import torch

    from minipaged.engine.llm import LLM

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
        print_completions(output.outputs, output.prompt)


def run_chat(args: argparse.Namespace) -> None:
    params = chat_sampling_params(args)  # bad values fail before loading
    llm = llm_from_args(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    if args.message is not None:
        messages = [*system, {"role": "user", "content": args.message}]
        print_completions(llm.chat(messages, params, use_tqdm=False)[0].outputs)
        return
    enable_line_editing()
    chat_session(llm, system, params)


def print_completions(completions: Sequence[Any], prompt: str = "") -> None:
    """Each completion after `prompt`, tagged with its index when there are several."""
    for completion in completions:
        tag = f"[{completion.index}] " if len(completions) > 1 else ""
        print(f"{tag}{prompt}{completion.text}")


def run_serve_command(args: argparse.Namespace) -> None:
    run_serve(args, lambda: llm_from_args(args).engine)


# -- the interactive chat -------------------------------------------------------------------------


def enable_line_editing() -> None:
    """Arrow keys, line editing and this session's history for `input()` on a terminal.

    Importing `readline` is what switches them on; on a pipe (or where Python has no `readline`)
    `input()` stays as it is.
    """
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401


def chat_session(llm: Any, system: list[dict[str, str]], params: Any) -> list[dict[str, str]]:
    """Read a line, stream the answer as it is generated, repeat; return the conversation.

    Blank lines are skipped and `/help`, `/reset`, `/exit` are commands (a word that starts with
    "/" and is none of them is refused, not sent). Ctrl-D or `/exit` ends the session; Ctrl-C
    clears the line being typed, or stops the answer being generated, which then stays out of
    the conversation.
    """
    print("minipaged chat: /help lists the commands; Ctrl-D or /exit ends the session.")
    messages = list(system)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()  # the shell's prompt starts on a line of its own
            return messages
        except KeyboardInterrupt:
            print()
            continue
        if not line:
            continue
        word = line.split()[0]
        if word == "/exit":
            return messages
        if word == "/reset":
            messages = list(system)
            print("(a new conversation)")
            continue
        if word == "/help":
            print(CHAT_HELP)
            continue
        if line.startswith("/") and " " not in line:
            print(f"unknown command {line}; /help lists the commands")
            continue
        turn = [*messages, {"role": "user", "content": line}]
        answer = print_answer(stream_answer(llm, turn, params))
        if answer is not None:
            messages = [*turn, {"role": "assistant", "content": answer}]


def stream_answer(llm: Any, messages: list[dict[str, str]], params: Any) -> TextStream:
    """`llm.chat_stream(messages, params)`, whose request is aborted if the stream is closed or
    interrupted before the answer is complete, so no unfinished request (nor its KV blocks) is
    left behind in the engine."""
    from minipaged.engine.llm import stream_text

    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    request_id = llm.engine.add_request(None, prompt, params)
    try:
        yield from stream_text(llm.engine, request_id)
    finally:
        llm.engine.abort_request(request_id)  # a no-op once the request has finished


def print_answer(pieces: TextStream) -> str | None:
    """Print an answer as it streams; return it, or None when Ctrl-C stopped it."""
    print("bot> ", end="", flush=True)
    shown = []
    try:
        for piece in pieces:
            shown.append(piece)
            print(piece, end="", flush=True)
    except KeyboardInterrupt:
        pieces.close()  # aborts the request if the interrupt came while the stream waited
        print("\n(answer stopped; it is not part of the conversation)")
        return None
    print()
    return "".join(shown)


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
