"""A conversation with a chat model, as requests carry it (``models.text.chat`` renders it as the model's prompt)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_MESSAGES = 256  # turns a conversation holds
MAX_CONTENT_CHARS = 1 << 16  # characters a turn holds


class ChatMessage(BaseModel):
    """One turn of a conversation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_CONTENT_CHARS)
