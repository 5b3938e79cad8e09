"""OpenAI request schemas (pydantic) and the OpenAI error shape.

Requests forbid unknown fields: a parameter we do not implement gets a 400
that names it instead of being silently ignored. A JSON null means "use the
default", as OpenAI treats it. Types are strict: "8" is not an integer, false
is not a token id, NaN is not a temperature; the client is told, not guessed at.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specdec_core.sampling import SamplingParams

log = logging.getLogger("specdec.server")


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


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong, and what to do about it")
    type: str = Field(description="invalid_request_error, rate_limit_error or server_error")
    param: str | None = Field(description="The request field at fault, if one is")
    code: str | None = Field(description="A stable name for the error, if it has one")


class ErrorBody(BaseModel):
    """The body of every 4xx and 5xx answer."""

    error: ErrorDetail


# What the OpenAPI schema says the API answers besides 200 (app.py removes FastAPI's unused 422).
ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in {
        400: "The request is invalid; the message says how",
        401: "A valid API key is required",
        404: "No such model or path",
        405: "Method not allowed (see the Allow header)",
        408: "The request body did not arrive in time",
        413: "The request body is too large",
        429: "A rate limit or the queue is full (see Retry-After)",
        500: "The server failed (the request was fine); its log has the cause",
        503: "Loading, draining or shutting down",
    }.items()
}


def internal_error(what: str, exc: BaseException) -> APIError:
    """A 500 for a failure of ours: the cause goes to the log under an incident id, never to the client."""
    incident = uuid.uuid4().hex[:12]
    log.error("%s (incident %s)", what, incident, exc_info=(type(exc), exc, exc.__traceback__))
    return APIError(
        500, f"{what}; this is the server's fault, not the request's: its log has the cause under incident {incident}",
        type="server_error", code="internal_error",
    )


def validation_error(errors: list[dict]) -> APIError:
    """A 400 from pydantic's errors: every problem in the message, the first one's top-level field as param."""
    messages = []
    for error in errors:
        # Union members name themselves in loc ("list[TextPart]", "function-after[...]"): not the client's words.
        loc = [part for part in error.get("loc", ()) if part != "body" and not (isinstance(part, str) and "[" in part)]
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        if error["type"] == "extra_forbidden":
            messages.append(f"{path} is not supported by this server")
        elif error["type"] == "json_invalid":
            messages.append("the request body is not valid JSON")
        else:
            messages.append(f"{path}: " * bool(path) + _message(error))
    loc = [part for part in errors[0].get("loc", ()) if part != "body"]
    if not loc and errors[0]["type"] == "missing":  # no body at all
        return APIError(400, "the request has no body: send a JSON object with Content-Type: application/json")
    param = loc[0] if loc and isinstance(loc[0], str) and errors[0]["type"] != "json_invalid" else None
    return APIError(400, "; ".join(messages), param=param)


def _message(error: dict) -> str:
    """pydantic's words for one error, with what to do where they leave it out."""
    if error["type"] == "string_unicode":
        return "is not valid Unicode (an unpaired UTF-16 surrogate such as \\ud800?); send valid Unicode text"
    return error["msg"].removeprefix("Value error, ")


def _valid_unicode(text: str) -> str:
    """JSON may escape a lone UTF-16 surrogate (\\ud800), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains an unpaired UTF-16 surrogate ({text[exc.start]!r} at character {exc.start}); send valid Unicode text"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
TOKEN_ID_DIGITS = 10  # logit_bias keys are token ids: no vocabulary has 10**10 tokens


class Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

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
    # vLLM's extension: with include_usage, every chunk carries the usage so far (usage.speculative too).
    continuous_usage_stats: bool = False


NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's, for a schema's and a function's name


class TextResponse(Schema):
    type: Literal["text"]


class JsonObjectResponse(Schema):
    type: Literal["json_object"]


class JsonSchemaSpec(Schema):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema", description="The JSON Schema the output must follow")
    strict: bool | None = None  # accepted for compatibility: the output always follows the schema


class JsonSchemaResponse(Schema):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextResponse | JsonObjectResponse | JsonSchemaResponse, Field(discriminator="type")]


class SamplingRequest(Schema):
    """The fields completions and chat share."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)  # upper bounds of n, stop and top_logprobs: config (security.limits), server/request_limits.py
    stream: bool = False
    stream_options: StreamOptions = Field(default_factory=StreamOptions)
    stop: Annotated[list[Text], BeforeValidator(_as_list)] = Field(default_factory=list)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] = Field(default_factory=dict)
    user: str | None = None  # accepted for compatibility; not used
    # vLLM's name: requests share cached prompt chunks only when their salts (and API keys) are equal.
    cache_salt: str | None = Field(None, max_length=256)
    response_format: ResponseFormat | None = None
    # This server's extensions (docs/API.md, "Request extensions"): the playground's, usable by any client.
    speculation: bool = Field(True, description="false: decode this request plainly (gamma 0); the text is the same")
    return_token_sources: bool = Field(
        False, description="Each choice (and each streamed chunk) lists its tokens' sources: drafter, grammar or target",
    )

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float]) -> dict[str, float]:
        for key in bias:
            # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
            if not (key.isascii() and key.isdigit() and len(key) <= TOKEN_ID_DIGITS):
                raise ValueError(f"key {key[:20]!r} is not a token id (a decimal integer as a string, such as \"50256\")")
        return bias

    def sampling(self, index: int, vocab_size: int) -> SamplingParams:
        """Sampling settings of the index-th of n sequences (seed + index, so each differs yet reproduces)."""
        bias = {int(key): value for key, value in self.logit_bias.items()}
        if bias and max(bias) >= vocab_size:
            raise APIError(400, f"logit_bias key {max(bias)} is not a token id below {vocab_size}", param="logit_bias")
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias,
            seed=None if self.seed is None else self.seed + index,
        )


PromptText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = (
    PromptText | Annotated[list[PromptText], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
)


def prompt_items(prompt: str | list) -> list[str | list[int]]:
    """The prompts of a completion request: a string or one list of token ids is one prompt."""
    return [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt_shape(cls, value: Any, handler: Any) -> Any:
        # pydantic would list why the value fits none of the four shapes, one error each; the one
        # that got deepest into the value, past its type, is the shape the client meant.
        try:
            return handler(value)
        except ValidationError as exc:
            deepest = max(exc.errors(), key=lambda error: (
                sum(isinstance(part, int) for part in error["loc"]), not error["type"].endswith("_type")))
            where = "".join(f"[{part}]" for part in deepest["loc"] if isinstance(part, int))
            raise ValueError(
                "must be a non-empty string, a list of non-empty strings, a list of token ids (integers >= 0), "
                f"or a list of such lists; prompt{where}: {_message(deepest)}"
            ) from None

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, value: int) -> int:
        if value > 1:
            raise ValueError("values above 1 are not supported; use n for several completions")
        return value


class TextPart(Schema):
    type: Literal["text"]
    text: Text


class FunctionCall(Schema):
    name: str
    arguments: str  # a JSON object, as text (as OpenAI returns it)

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError:
            raise ValueError("is not JSON: send the arguments the assistant message's tool call carried") from None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object")
        return arguments


class ToolCall(Schema):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None  # tool messages: the call this answers

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (an assistant message may instead carry tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool messages, and only they, carry tool_call_id: the id of the call they answer")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def as_template_input(self) -> dict:
        message = {"role": self.role, "content": self.text} | ({"name": self.name} if self.name else {})
        if self.tool_calls:  # templates write the arguments out as JSON themselves
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionSpec(Schema):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; none: any JSON object
    strict: bool | None = None  # accepted for compatibility: the arguments always follow the schema


class Tool(Schema):
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(Schema):
    name: str


class NamedToolChoice(Schema):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # none given: auto with tools, none without
    parallel_tool_calls: bool = True

    @property
    def calls_tools(self) -> bool:
        """Whether the model may call the request's tools."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int, info: ValidationInfo) -> int:
        if value and not info.data.get("logprobs"):  # 0 asks for nothing, with or without logprobs
            raise ValueError("top_logprobs requires logprobs to be true")
        return value
