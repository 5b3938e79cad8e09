"""The size limits on a request's fields and its tokenized prompt (security.limits): a 400 naming the limit.

The guard cannot check these: they need the parsed request and the tokenized prompt, so the routes call them.
"""

from __future__ import annotations

from .schemas import APIError, ChatRequest, CompletionRequest, prompt_items
from .settings import LimitsConfig


def _at_most(limits: LimitsConfig, setting: str, value: int, param: str, what: str | None = None) -> None:
    """A 400 naming the limit `setting` of security.limits when value is above it."""
    limit = getattr(limits, setting)
    if value > limit:
        raise APIError(
            400, f"{what or param} is {value}, above this server's limit of {limit} (security.limits.{setting})",
            param=param, code="limit_exceeded",
        )


def check_request(limits: LimitsConfig, body: CompletionRequest | ChatRequest) -> None:
    """Refuse the first field of the request that is past its limit."""
    _at_most(limits, "max_n", body.n, "n")
    prompts = len(prompt_items(body.prompt)) if isinstance(body, CompletionRequest) else 1
    # Each sequence costs memory and batch slots: prompts x n is the request's share of the server.
    _at_most(limits, "max_sequences", prompts * body.n, "n" if prompts == 1 else "prompt",
             f"the number of sequences asked for ({prompts} prompts x n = {body.n})")
    _at_most(limits, "max_stop", len(body.stop), "stop", "the number of stop strings")
    _at_most(limits, "max_stop_length", max(map(len, body.stop), default=0), "stop", "the longest stop string's length")
    _at_most(limits, "max_logit_bias", len(body.logit_bias), "logit_bias", "the number of logit_bias entries")
    if isinstance(body, ChatRequest):
        _at_most(limits, "max_messages", len(body.messages), "messages", "the number of messages")
        _at_most(limits, "max_top_logprobs", body.top_logprobs or 0, "top_logprobs")
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        _at_most(limits, "max_tokens", body.max_completion_tokens or body.max_tokens or 0, param)
    else:
        _at_most(limits, "max_top_logprobs", body.logprobs or 0, "logprobs")
        _at_most(limits, "max_tokens", body.max_tokens, "max_tokens")


def check_prompt_tokens(limits: LimitsConfig, tokens: int, param: str) -> None:
    _at_most(limits, "max_prompt_tokens", tokens, param, "the number of prompt tokens")
