"""Request bodies of the OpenAI API and its error shape.

Every field of OpenAI's and vLLM's requests is either honoured or, when set to anything but
its neutral value, refused with a 400 naming it: an evaluation harness must never get
numbers computed without the option it asked for. Unknown fields are ignored (clients send
more than any server uses).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

# fields this server cannot honour, and the value that means "not asked for"
_UNSUPPORTED: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "logit_bias": None, "min_p": 0.0, "min_tokens": 0, "suffix": None, "tools": None,
    "tool_choice": None, "functions": None, "function_call": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    n: int = Field(default=1, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 2**16)  # torch's range
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None  # metadata only
    response_format: dict | None = None
    # vLLM's extensions
    top_k: int = Field(default=0, ge=-1)  # -1 and 0: all tokens
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0)
    # refused unless neutral (see _UNSUPPORTED)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    suffix: str | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _refuse_what_is_not_honoured(self) -> _Sampling:
        for name, neutral in _UNSUPPORTED.items():
            value = getattr(self, name, neutral)
            if value not in (neutral, None) and value != {} and value != []:
                raise ValueError(f"{name}: not supported by this server (got {value!r}); "
                                 f"leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of == n is supported (got {self.best_of}, "
                             f"n={self.n})")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list, empty strings dropped."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    @property
    def num_logprobs(self) -> int | None:
        """Top log-probabilities asked for per generated token (None: none)."""
        return None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt as text or as token ids."""

    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @model_validator(mode="after")
    def _no_streamed_logprobs(self) -> CompletionRequest:
        if self.stream and (self.logprobs is not None or self.echo):
            raise ValueError("logprobs: not supported with stream: true (nor echo); "
                             "ask for a whole completion")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


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

    @model_validator(mode="after")
    def _text_parts_only(self) -> ChatMessage:
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content: only text parts are supported, got a "
                                     f"{part.type!r} part")
        return self

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
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _logprobs_shape(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.stream and self.logprobs:
            raise ValueError("logprobs: not supported with stream: true; ask for a whole "
                             "completion")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code if code is not None else str(status)}},
                        status_code=status, headers=headers)
