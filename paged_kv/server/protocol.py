"""Request bodies of the OpenAI API (the fields this server honours) and its error shape."""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


class _Sampling(BaseModel):
    # unknown fields are ignored (clients send more than we use); known ones are typed
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 2**16)  # torch's range
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    # vLLM's extensions
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list, empty strings dropped."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt as text or as token ids."""

    prompt: str | list[int]


class ChatMessage(BaseModel):
    """One chat turn; content is text."""

    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code if code is not None else str(status)}},
                        status_code=status, headers=headers)
