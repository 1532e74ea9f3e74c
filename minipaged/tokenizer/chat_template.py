"""Layer 1: chat templates, the model's own Jinja program that turns a conversation into text.

A template is rendered the way ``transformers`` renders it, so that a prompt is the one the
model was trained on: a sandboxed, immutable Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, loop controls (``{% break %}``), ``namespace()``, ``raise_exception``,
``strftime_now`` and a ``tojson`` filter that does not escape HTML. The variables are
``messages`` (with None-valued keys dropped), ``tools`` and ``documents`` (None unless given, so
that ``tools is not none`` tests work), ``add_generation_prompt``, the special tokens that are
set (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``) and any extra keyword arguments
(``enable_thinking=False``, ``date_string=...``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from minipaged.tokenizer.bpe import TokenizerError


class ChatTemplateError(TokenizerError):
    """Raised by a chat template's own ``raise_exception(...)``, for a template that is not
    valid Jinja, or for one that fails as it renders."""


def render_chat_template(
    template: str,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[dict[str, Any]] | None = None,
    documents: Sequence[dict[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Render ``template`` for ``messages`` (a list of ``{"role": ..., ...}`` dicts). A template
    is data: whatever makes it fail as it renders (an undefined name in arithmetic, a division
    by zero, the sandbox refusing an operation) raises `ChatTemplateError`, as its own
    ``raise_exception`` does."""
    compiled, checked = _compile(template), _checked_messages(messages)
    try:
        return compiled.render(
            messages=checked,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except ChatTemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the template's own code
        raise ChatTemplateError(
            f"the chat template failed to render: {type(e).__name__}: {e}"
        ) from e


def template_from_config(value: Any) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or a list of named templates (the
    one named "default" is used)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default", next(iter(named.values()), None))
    raise TokenizerError(f"chat_template must be a string or a list, not {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# Helpers: input checks and the Jinja environment
# ---------------------------------------------------------------------------------------------


def _checked_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as fresh dicts without None values (an OpenAI-style ``"content": None``
    next to ``tool_calls`` would otherwise render as "None")."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizerError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if not messages:
        raise TokenizerError("messages is empty: a conversation needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise TokenizerError(f"messages[{i}] must be a dict with a 'role' (got {message!r})")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``tojson`` as transformers defines it (no HTML escaping, unlike Jinja's own)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """Compile a chat template in the environment described at the top of this module."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """Accept ``{% generation %}...{% endgeneration %}`` (used to mark assistant text for
        training masks) and render its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {e}") from e
