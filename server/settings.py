"""The server's sections of a config file (server, security), and `ServeConfig`: the whole file as
`specdec serve` reads it. Every option has a working default and a one-line description."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from specdec_core.config import Config, Section


class ServerConfig(Section):
    host: str = Field("127.0.0.1", description="Address to bind")
    port: int = Field(8000, description="Port to bind")
    served_model_name: str | None = Field(None, description="Model name clients use; defaults to the target's name")
    max_batch_size: int = Field(8, ge=1, description="Most sequences decoded together")
    max_queue: int = Field(64, ge=1, description="Requests waiting beyond this get 429")
    max_model_len: int | None = Field(None, description="Context limit; defaults to the model's own")
    shutdown_grace_s: float = Field(30.0, ge=0, description="On SIGTERM, how long in-flight requests may finish")
    replica_name: str | None = Field(None, description="What every response's X-Specdec-Replica header says (which replica answered, behind a load balancer); null: this host's name (a pod's, a container's)")
    playground: bool = Field(True, description="Serve the playground, a chat page that shows speculation, at / and /playground (no key needed for the page itself; its API calls need one)")
    drain_listen_s: float = Field(5.0, ge=0, description="On SIGTERM, how long the listener stays open answering 503 (on /health too) so load balancers see the drain; a second signal closes it at once")


class LimitsConfig(Section):
    max_body_bytes: int = Field(4 * 2**20, ge=1, description="Largest request body; larger ones get 413 while they arrive")
    body_timeout_s: float = Field(10.0, gt=0, description="Longest wait for a request's whole body; a slower one gets 408 and its connection closes")
    max_prompt_tokens: int = Field(65536, ge=1, description="Most prompt tokens in one request, all prompts together")
    max_tokens: int = Field(16384, ge=1, description="Largest max_tokens / max_completion_tokens; also caps chat's default")
    max_n: int = Field(16, ge=1, description="Largest n (choices per prompt)")
    max_sequences: int = Field(64, ge=1, description="Most sequences one request may create: its prompts times n")
    max_stop: int = Field(4, ge=0, description="Most stop strings per request")
    max_stop_length: int = Field(256, ge=1, description="Longest stop string, in characters")
    max_logit_bias: int = Field(300, ge=0, description="Most logit_bias entries")
    max_messages: int = Field(1024, ge=1, description="Most chat messages per request")
    max_top_logprobs: int = Field(
        20, ge=0, description="Largest chat top_logprobs and completions logprobs (the API caps the latter at 5)"
    )


class RateLimitConfig(Section):
    wrong_keys_per_minute: int | None = Field(
        30, ge=1, description="Requests with a wrong or missing API key per address per minute before 429s; null: unlimited"
    )
    requests_per_minute: int | None = Field(
        6000, ge=1, description="Requests per client per minute (a token bucket of this size); null: unlimited"
    )
    tokens_per_minute: int | None = Field(
        1_000_000, ge=1, description="Generated tokens per client per minute; a client in debt waits for the refill; null: unlimited"
    )


class SecurityConfig(Section):
    api_keys: list[str] = Field(
        default_factory=list,
        description="Keys accepted as 'Authorization: Bearer KEY'; none here, in api_key_file or in $SPECDEC_API_KEY: open",
    )
    api_key_file: str | None = Field(None, description="A file of further keys, one per line (# starts a comment)")
    metrics: Literal["open", "key", "port"] = Field(
        "open", description="/metrics is open, needs a key like /v1/*, or is served only on metrics_port"
    )
    metrics_port: int = Field(9464, ge=0, description="With metrics: port, the metrics listener's port on server.host (0: any free)")
    cors_origins: list[str] = Field(
        default_factory=list, description="Origins browsers may call from (CORS); empty turns CORS off, ['*'] allows any"
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request size limits, each answered with a 4xx naming it")
    rate_limit: RateLimitConfig = Field(
        default_factory=RateLimitConfig, description="Per-client budgets (per key, else per address); 429 with Retry-After"
    )


class ServeConfig(Config):
    """A whole config file: the runtime's sections and the server's; unknown sections are an error here."""

    model_config = ConfigDict(extra="forbid")

    server: ServerConfig = Field(default_factory=ServerConfig, description="HTTP server and scheduler")
    security: SecurityConfig = Field(default_factory=SecurityConfig, description="API keys, request limits, rate limits, CORS")
