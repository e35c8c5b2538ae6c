"""How a request to a language model chooses its tokens: the value type requests and passes carry
(``models.text.sampling`` does the choosing)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_SEED = (1 << 63) - 1


class Sampling(BaseModel):
    """How a request chooses its tokens (OpenAI's and llama.cpp's parameters). ``temperature`` 0 is greedy (the
    penalties still apply); ``top_k`` 0 keeps every token, ``top_p`` 1 and ``min_p`` 0 likewise. ``repetition_penalty``
    divides a seen token's positive logit and multiplies its negative one (1: none); ``presence_penalty`` is
    subtracted from every seen token's logit once, ``frequency_penalty`` once per time it was seen. Seen: the prompt's
    and the generated tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_k: int = Field(default=0, ge=0, le=1 << 20)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
