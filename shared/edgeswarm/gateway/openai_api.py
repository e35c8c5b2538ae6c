"""The OpenAI API's request and answer shapes the gateway speaks (``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``), and their translation to and from a serve-hmp request.

Requests are validated here with caps on every size; fields of the API the gateway does not implement are ignored
when they change nothing (``user``, ``logprobs: false``) and refused when they would (``n`` above 1,
``logprobs: true``, ``echo``, tools), so a client never gets an answer to a question it did not ask. Beside
OpenAI's sampling fields it takes llama.cpp's and vLLM's ``top_k``, ``min_p`` and ``repetition_penalty``. As
OpenAI's, sampling is on by default (temperature 1); without a ``seed`` each request draws its own.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from edgeswarm.messages.hmp import MAX_NEW_TOKENS, MAX_STOP_CHARS, MAX_TEXT_CHARS
from edgeswarm.values.chat import MAX_CONTENT_CHARS, MAX_MESSAGES, ChatMessage
from edgeswarm.values.sampling import MAX_SEED, Sampling

MAX_OPENAI_STOPS = 4  # OpenAI's own cap
MAX_MODEL_CHARS = 64
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class ApiError(Exception):
    """An answer in OpenAI's error shape: HTTP ``status``, ``kind`` (the error's ``type``), ``message`` for the user,
    and the ``param`` and ``code`` it concerns."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _unsupported(cls: type, value: Any, info: ValidationInfo) -> Any:
    """A field of OpenAI's API this server does not implement: refused when set (empty or false is what it does)."""
    if value:
        raise ValueError(f"{info.field_name} is not supported")
    return value


class TextPart(BaseModel):
    """A part of a message's content; only text parts are read."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str = Field(max_length=MAX_CONTENT_CHARS)


class ApiMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None)

    def as_chat(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        if len(text) > MAX_CONTENT_CHARS:
            raise ApiError(400, f"a message holds at most {MAX_CONTENT_CHARS} characters", param="messages")
        # OpenAI's "developer" turn is what chat templates call the system turn.
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=text)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Generation(BaseModel):
    """What both endpoints share: the model (a serving job's name), how many tokens, how to sample, where to stop."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1 << 20)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    logprobs: bool | int | None = None

    _no_logprobs = field_validator("logprobs")(_unsupported)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_OPENAI_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_OPENAI_STOPS} stop strings of 1 to {MAX_STOP_CHARS} characters")
        return value

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                        repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty,
                        seed=self.seed if self.seed is not None else secrets.randbelow(MAX_SEED))

    @property
    def usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[ApiMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    tools: list[Any] | None = None

    _no_tools = field_validator("tools")(_unsupported)

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[ChatMessage]:
        return [m.as_chat() for m in self.messages]


class CompletionRequest(_Generation):
    """``POST /v1/completions``: one prompt, text or token ids."""

    prompt: str | list[int] = Field(max_length=MAX_TEXT_CHARS)
    echo: bool = False
    suffix: str | None = None

    _no_echo_or_suffix = field_validator("echo", "suffix")(_unsupported)

    def new_tokens(self) -> int:
        return self.max_tokens or COMPLETION_DEFAULT_TOKENS


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Answer(BaseModel):
    """One answer as the endpoints write it (``chat`` or not), whole or as stream chunks."""

    model_config = ConfigDict(frozen=True)

    id: str
    model: str
    chat: bool
    created: int = Field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def whole(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, finish: str | None = None, *, first: bool = False) -> dict[str, Any]:
        """A stream chunk adding ``text`` (``first``: the chat's one that names the role), or ending with
        ``finish``."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {"id": self.id, "object": f"{self.object}.chunk" if self.chat else self.object,
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The stream's last chunk when the request asked for usage: no choices, the counts."""
        return {"id": self.id, "object": f"{self.object}.chunk" if self.chat else self.object,
                "created": self.created, "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}


def model_entry(name: str, created: float) -> dict[str, Any]:
    """One entry of ``GET /v1/models``."""
    return {"id": name, "object": "model", "created": int(created), "owned_by": "edgeswarm"}
