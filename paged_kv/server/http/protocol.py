"""Request bodies of the OpenAI API and its error shape.

Every field of OpenAI's and vLLM's requests is either honoured or, when set to anything but
its neutral value, refused with a 400 naming it: an evaluation harness must never get
numbers computed without the option it asked for. Unknown fields are ignored (clients send
more than any server uses). Checks sit on the field they refuse (field validators), so the
400 names it in ``param``; every integer has an upper bound, so nothing a client sends is
too large to reach the engine core (msgpack carries 64-bit integers).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ...handoff.params import parse_params

MAX_PRIORITY = 99  # paged_kv.tenants.MAX_PRIORITY (a request's retention priority)
MAX_INT = 2**63 - 1  # the largest integer msgpack (msgspec) sends as a signed int
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a million-token prompt as text; far past any context

Count = Annotated[int, Field(ge=1, le=MAX_INT)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_INT)]  # --max-logprobs bounds it (service)

# fields this server cannot honour, and the value that means "not asked for"
_UNSUPPORTED: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "logit_bias": None, "min_p": 0.0, "min_tokens": 0, "suffix": None, "tools": None,
    "tool_choice": None, "functions": None, "function_call": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
}


@dataclasses.dataclass(frozen=True)
class InputLimits:
    """What one request may ask of the API server (``paged-kv serve`` flags).

    Parameters
    ----------
    max_logprobs : int
        The most top log-probabilities per token: ``logprobs``, chat's ``top_logprobs``
        and ``prompt_logprobs`` (``--max-logprobs``; vLLM's default, 20).
    max_request_bytes : int
        The largest request body, refused with 413 before it is parsed
        (``--max-request-bytes``).
    """

    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs: expected >= 0, got {self.max_logprobs}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes: expected >= 1, got {self.max_request_bytes}")


DEFAULT_LIMITS = InputLimits()


class StreamOptions(BaseModel):
    """``stream_options``: usage once at the end of a stream (``include_usage``), and with
    it, vLLM's usage so far in every chunk (``continuous_usage_stats``; alone it asks for
    nothing, as in vLLM)."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None

    @property
    def continuous(self) -> bool:
        """Whether every chunk carries the usage so far."""
        return bool(self.include_usage and self.continuous_usage_stats)


def _no_stream(info: ValidationInfo) -> None:
    if info.data.get("stream"):
        raise ValueError("not supported with stream: true; ask for a whole completion")


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Count | None = None
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    n: Count = 1
    best_of: Count | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 2**16)  # torch's range
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # metadata only
    response_format: dict | None = None
    # vLLM's extensions
    top_k: int = Field(default=0, ge=-1, le=MAX_INT)  # -1 and 0: all tokens
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    prompt_logprobs: NumLogprobs | None = None
    # soft retention of the request's cached blocks once it finishes (SGLang / TensorRT-LLM
    # style; paged_kv.tenants): None takes the tenant's defaults
    priority: Annotated[int, Field(strict=True, ge=0, le=MAX_PRIORITY)] | None = None
    retention_seconds: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    # prefill on one engine, decode on another (vLLM's name; paged_kv.handoff.params)
    kv_transfer_params: Any = None
    # refused unless neutral (see _UNSUPPORTED)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None
    min_p: float = 0.0
    min_tokens: int = Field(default=0, ge=-MAX_INT, le=MAX_INT)
    suffix: str | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list | None = None
    guided_grammar: str | None = None

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _refuse_what_is_not_honoured(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = _UNSUPPORTED[info.field_name]
        if value not in (neutral, None) and value != {} and value != []:
            raise ValueError(f"not supported by this server (got {value!r}); leave it out")
        return value

    @field_validator("kv_transfer_params")
    @classmethod
    def _handoff_params(cls, value: Any) -> Any:
        parse_params(value)  # ValueError naming kv_transfer_params.FIELD: a 400
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(f"only best_of == n is supported (got {value}, n={n})")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: dict | None) -> dict | None:
        if value and value.get("type", "text") != "text":
            raise ValueError("only {'type': 'text'} is supported")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_a_stream(cls, value: StreamOptions | None, info: ValidationInfo,
                                      ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream: true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_whole(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None:
            _no_stream(info)  # (as vLLM: a stream has nowhere to put them)
        return value

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list, empty strings dropped."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    @property
    def num_logprobs(self) -> int | None:
        """Top log-probabilities asked for per generated token (None: none)."""
        return None

    @property
    def logprob_asks(self) -> dict[str, int]:
        """``{field: how many top log-probabilities it asks for}``, for the fields set (each
        bounded by `InputLimits.max_logprobs`)."""
        return {} if self.prompt_logprobs is None else {"prompt_logprobs": self.prompt_logprobs}


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt as text or as token ids."""

    prompt: str | list[int]  # token ids: the engine's vocabulary bounds them (service)
    logprobs: NumLogprobs | None = None
    echo: bool = False

    @field_validator("logprobs", "echo")
    @classmethod
    def _no_streamed_logprobs(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, False):
            _no_stream(info)
        return value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def logprob_asks(self) -> dict[str, int]:
        asks = super().logprob_asks
        return asks if self.logprobs is None else {"logprobs": self.logprobs, **asks}


class TextPart(BaseModel):
    """One part of a message's content; only text parts are understood."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One chat turn; content is text, or a list of text parts (joined)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: str | list[TextPart]) -> str | list[TextPart]:
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"only text parts are supported, got a {part.type!r} "
                                     f"part")
        return content

    def as_template_message(self) -> dict[str, str]:
        """``{"role", "content"}`` for a chat template: parts joined, ``developer`` as
        ``system`` (OpenAI's newer name for it, which templates do not know)."""
        content = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role,
                "content": content}


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_streamed_logprobs(cls, value: bool, info: ValidationInfo) -> bool:
        if value:
            _no_stream(info)
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def logprob_asks(self) -> dict[str, int]:
        asks = super().logprob_asks
        return asks if self.top_logprobs is None else {"top_logprobs": self.top_logprobs,
                                                       **asks}


def bearer_tenant(api_keys: dict[str, str] | None, authorization: str) -> str | None:
    """The tenant of an ``Authorization: Bearer KEY`` header (None without api keys).

    Raises
    ------
    PermissionError
        The key is missing or unknown (its message is the 401's).
    """
    if api_keys is None:
        return None
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or key.strip() not in api_keys:
        raise PermissionError("missing or unknown API key: send Authorization: Bearer KEY")
    return api_keys[key.strip()]


# OpenAI's error types by status (a 429's code too: OpenAI's clients and dashboards read a
# rate limit from it, not from invalid_request_error); any other status is a bad request.
# One table for the server and the router, so a client reads both alike.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               429: "rate_limit_exceeded", 503: "server_error"}
ERROR_CODES = {429: "rate_limit_exceeded"}


def status_error(status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    """`error_response` typed (and coded) by `status` as OpenAI types it (`ERROR_TYPES`)."""
    return error_response(status, message, param=param, headers=headers,
                          type_=ERROR_TYPES.get(status, "invalid_request_error"),
                          code=ERROR_CODES.get(status))


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    # a message never fails to encode (a lone surrogate quoted from a request would)
    message = message.encode("utf-8", "backslashreplace").decode()
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code if code is not None else str(status)}},
                        status_code=status, headers=headers)
