"""OpenAI request schemas (pydantic) and the OpenAI error shape.

Requests forbid unknown fields: a parameter we do not implement gets a 400
that names it instead of being silently ignored. A JSON null means "use the
default", as OpenAI treats it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from specdec_core.sampling import SamplingParams


class APIError(Exception):
    """An error answered as OpenAI shapes it: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(errors: list[dict]) -> APIError:
    """A 400 from pydantic's errors: every problem in the message, the first one's top-level field as param."""
    messages = []
    for error in errors:
        loc = [part for part in error.get("loc", ()) if part != "body"]
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        if error["type"] == "extra_forbidden":
            messages.append(f"{path} is not supported by this server")
        elif error["type"] == "json_invalid":
            messages.append("the request body is not valid JSON")
        else:
            messages.append(f"{path}: " * bool(path) + error["msg"].removeprefix("Value error, "))
    loc = [part for part in errors[0].get("loc", ()) if part != "body"]
    param = loc[0] if loc and isinstance(loc[0], str) and errors[0]["type"] != "json_invalid" else None
    return APIError(400, "; ".join(messages), param=param)


class Schema(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


def _as_list(value: Any) -> Any:
    """OpenAI's `stop` may be one string or a list of them."""
    return [value] if isinstance(value, str) else value


class StreamOptions(Schema):
    include_usage: bool = False


class SamplingRequest(Schema):
    """The fields completions and chat share."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)  # upper bounds of n, stop and top_logprobs: config (security.limits), server/security.py
    stream: bool = False
    stream_options: StreamOptions = Field(default_factory=StreamOptions)
    stop: Annotated[list[str], BeforeValidator(_as_list)] = Field(default_factory=list)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] = Field(default_factory=dict)
    user: str | None = None  # accepted for compatibility; not used

    def sampling(self, index: int, vocab_size: int) -> SamplingParams:
        """Sampling settings of the index-th of n sequences (seed + index, so each differs yet reproduces)."""
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit() or int(key) >= vocab_size:
                raise APIError(400, f"logit_bias key {key!r} is not a token id below {vocab_size}", param="logit_bias")
            bias[int(key)] = value
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias,
            seed=None if self.seed is None else self.seed + index,
        )


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, value: int) -> int:
        if value > 1:
            raise ValueError("values above 1 are not supported; use n for several completions")
        return value


class TextPart(Schema):
    type: Literal["text"]
    text: str


class ChatMessage(Schema):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": content} | ({"name": self.name} if self.name else {})


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int, info: ValidationInfo) -> int:
        if not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value
