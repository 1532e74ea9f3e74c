"""What clients may send: the OpenAI request bodies, their validation, and `SamplingParams`.

Validation happens in three places, each the single owner of its rules: pydantic checks the
*shape* of a body (JSON, field types, required fields, 64-bit integers, finite numbers, the
message roles and their content, at most `MAX_STOP_STRINGS` stop strings); `SamplingParams`
checks the *values* (ranges, combinations), exactly as it does for the offline `LLM`; and
`check_model_limits` / `check_context` check what depends on the served model: `top_k` and
`stop_token_ids` against its vocabulary, prompt plus `max_tokens` against its context (vLLM's
"This model's maximum context length is N tokens. However, you requested M tokens (P in the
messages, Q in the completion)"). Every failure becomes a `RequestError`: HTTP 400 with
OpenAI's / vLLM's error body `{"error": {"message", "type", "param", "code"}}`, `param` naming
the field.

Field names, defaults and extras follow vLLM's OpenAI server: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos` and `stop_token_ids` are accepted beside
OpenAI's own; unknown fields are ignored, as OpenAI's clients send some this server does not
use (`user`, ...); fields it cannot honour (`echo`, `suffix`, `logit_bias`, ...) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from http import HTTPStatus
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from minipaged.sampling.params import RequestOutputKind, SamplingParams

# `max_tokens` of a completion when the request gives none (OpenAI's and vLLM's default).
DEFAULT_COMPLETION_MAX_TOKENS = 16
# The most alternatives per token a request may ask for (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20
# The most stop strings a request may give (OpenAI allows 4; vLLM sets no cap). Each one is
# searched for in the new text of every step, so they cost every step of the request.
MAX_STOP_STRINGS = 16
# The roles a chat message may have (OpenAI's), and those whose message must have content.
ROLES = ("system", "developer", "user", "assistant", "tool")
ROLES_WITH_CONTENT = frozenset({"system", "developer", "user", "tool"})
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))

# JSON numbers as the sampler and the engine hold them: integers in int64, finite floats.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Finite = Annotated[float, Field(allow_inf_nan=False)]

# -- errors ---------------------------------------------------------------------------------------


@dataclass
class RequestError(Exception):
    """A request the server refuses; `body()` is what the client receives."""

    message: str
    param: str | None = None
    status: HTTPStatus = HTTPStatus.BAD_REQUEST
    type: str = "BadRequestError"

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": int(self.status),
            }
        }


def not_found(message: str, param: str | None = None) -> RequestError:
    return RequestError(message, param, HTTPStatus.NOT_FOUND, "NotFoundError")


def service_unavailable(message: str) -> RequestError:
    return RequestError(message, None, HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError")


# -- request bodies -------------------------------------------------------------------------------


class _Strict(BaseModel):
    """A JSON object of the body: its fields' types are checked strictly (no coercion), keys
    this server does not read are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """The fields the two endpoints share: the model, streaming and sampling settings."""

    model: str | None = None  # None: the one model this server serves
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int64 | None = None
    n: Int64 = 1
    temperature: Finite | None = None  # None: SamplingParams' default (1.0, as OpenAI)
    top_p: Finite = 1.0
    top_k: Int64 = 0
    min_p: Finite = 0.0
    seed: int | None = None  # SamplingParams checks [0, 2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    presence_penalty: Finite = 0.0
    frequency_penalty: Finite = 0.0
    repetition_penalty: Finite = 1.0
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    # OpenAI fields this server cannot honour; a request that sets one is refused.
    logit_bias: dict[str, float] | None = None
    best_of: Int64 | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        return stop

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A field sent as `null` takes its default, as in vLLM (OpenAI's clients send some)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in _REQUIRED}
        return data

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        """Refuse what this server would otherwise silently ignore."""
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", "logit_bias")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(
                f"best_of must equal n ({self.n}) or be left out, got {self.best_of}", "best_of"
            )
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", "stream_options")

    def check_model_limits(self, vocab_size: int) -> None:
        """What only the served model bounds: `top_k` and `stop_token_ids` index its logits."""
        if self.top_k > vocab_size:
            raise RequestError(
                f"top_k must be -1 or 0 (off) or at most the vocabulary size {vocab_size}, "
                f"got {self.top_k}",
                "top_k",
            )
        bad = [t for t in self.stop_token_ids or () if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                "stop_token_ids",
            )

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """`SamplingParams` of this body (every shared field that has the same name, and
        `max_tokens` and `logprobs` as given); its `ValueError` names the field, so does ours."""
        values = {name: getattr(self, name) for name in _SHARED_FIELDS}
        values.update(max_tokens=max_tokens, logprobs=logprobs)
        # A stream sends each step's news, a whole answer its end: nothing else is built.
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        values["output_kind"] = kind
        if self.temperature is None:  # SamplingParams' default
            del values["temperature"]
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            raise self._in_body_terms(str(exc)) from None

    def aliases(self) -> dict[str, str]:
        """What each `SamplingParams` field is called in this body, where the names differ."""
        return {}

    def _in_body_terms(self, message: str) -> RequestError:
        """`SamplingParams`' messages begin with the field they are about: name the body's."""
        name, _, rest = message.partition(" ")
        if name not in SAMPLING_FIELDS:
            return RequestError(message)
        param = self.aliases().get(name, name)
        return RequestError(f"{param} {rest}", param)


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`: one prompt or a batch (text or token ids)."""

    prompt: Any = Field(...)
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        if not _is_prompt(prompt) and not (
            isinstance(prompt, list) and prompt and all(_is_prompt(p) for p in prompt)
        ):
            raise ValueError(
                "prompt must be a string, a list of token ids, or a non-empty list of either, "
                f"got {_short(prompt)}"
            )
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts this body asks to complete (one for a single prompt)."""
        return [self.prompt] if _is_prompt(self.prompt) else list(self.prompt)

    def sampling_params(self, prompt_lens: list[int], max_model_len: int) -> SamplingParams:
        """Without `max_tokens` a completion has 16 tokens, or what the context leaves. (The
        caller has run `check_supported`.)"""
        if self.echo:
            raise RequestError("echo is not supported", "echo")
        if self.suffix is not None:
            raise RequestError("suffix is not supported", "suffix")
        _check_logprobs(self.logprobs, "logprobs")
        for prompt_len in prompt_lens:
            check_context(prompt_len, self.max_tokens, max_model_len, "prompt", "max_tokens")
        max_tokens = self.max_tokens
        if max_tokens is None:
            room = max_model_len - max(prompt_lens, default=0)
            max_tokens = max(1, min(DEFAULT_COMPLETION_MAX_TOKENS, room))
        return self._sampling_params(max_tokens, self.logprobs)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        if self.content is None and self.role in ROLES_WITH_CONTENT:
            raise ValueError(f"content is required in a {self.role} message")
        return self

    def as_template_message(self) -> dict[str, str]:
        """The `{"role", "content"}` dict chat templates read; text parts are joined."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`: a conversation, answered with the model's chat template."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def aliases(self) -> dict[str, str]:
        return {"logprobs": "top_logprobs", "max_tokens": self.max_tokens_field()}

    def max_tokens_field(self) -> str:
        """The name of the field that gave `max_tokens` (chat has two spellings)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def conversation(self) -> list[dict[str, str]]:
        return [message.as_template_message() for message in self.messages]

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """Without `max_tokens` a chat answer may run to the end of the context (as OpenAI).
        (The caller has run `check_supported`.)"""
        if self.tools:
            raise RequestError("tools are not supported", "tools")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise RequestError("only the text response_format is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        _check_logprobs(self.top_logprobs, "top_logprobs")
        max_tokens = getattr(self, self.max_tokens_field())
        check_context(prompt_len, max_tokens, max_model_len, "messages", self.max_tokens_field())
        if max_tokens is None:  # whatever the context leaves
            max_tokens = max_model_len - prompt_len
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


# -- lengths --------------------------------------------------------------------------------------


def check_context(
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    prompt_field: str,
    tokens_field: str,
    at_least: str = "",
) -> None:
    """Refuse a prompt that leaves no room in the context, or that with `max_tokens` (when the
    client gave it) overflows the context, in vLLM's words. `at_least` qualifies the prompt's
    length where it is a lower bound (the prompt is not tokenized yet)."""
    where = "messages" if prompt_field == "messages" else "prompt"
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if prompt_len >= max_model_len:
        raise RequestError(
            f"{head}you requested {at_least}{prompt_len} tokens in the {where}, which leaves "
            f"no room for the completion. Please reduce the length of the {where}.",
            prompt_field,
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise RequestError(
            f"{head}you requested {at_least}{prompt_len + max_tokens} tokens ({at_least}"
            f"{prompt_len} in the {where}, {max_tokens} in the completion; {tokens_field}="
            f"{max_tokens}). Please reduce the length of the {where} or completion.",
            tokens_field,
        )


# -- parsing --------------------------------------------------------------------------------------


def parse_body(model: type[_SamplingRequest], body: bytes) -> Any:
    """The request `model` of a raw body, or a `RequestError` naming what is wrong."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        # pydantic's location also names union members ("str", "list[str]"): keep the path.
        loc = [str(p) for p in error["loc"] if isinstance(p, int) or p in _FIELD_NAMES]
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "json_invalid":
            raise RequestError(f"the body is not valid JSON: {message}") from None
        if not loc:
            raise RequestError(f"the body must be a JSON object: {message}") from None
        if error["type"] not in ("value_error", "missing"):
            message = f"{message}, got {_short(error.get('input'))}"
        raise RequestError(f"{'.'.join(loc)}: {message}", loc[0]) from None


# Fields whose `null` is refused rather than taken as the default: there is none.
_REQUIRED = frozenset({"prompt", "messages"})


def _check_logprobs(count: int | None, param: str) -> None:
    """Refuse a count of alternatives per token (when given) outside [0, `MAX_LOGPROBS`]."""
    if count is not None and not 0 <= count <= MAX_LOGPROBS:
        raise RequestError(f"{param} must be between 0 and {MAX_LOGPROBS}, got {count}", param)


def _is_prompt(value: Any) -> bool:
    """A single prompt: text, or a non-empty list of token ids."""
    return isinstance(value, str) or (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The body fields passed to `SamplingParams` as they are.
_SHARED_FIELDS = SAMPLING_FIELDS & _SamplingRequest.model_fields.keys()
_FIELD_NAMES = frozenset(
    name
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)
    for name in model.model_fields
)
