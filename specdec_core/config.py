"""Configuration: one YAML file, validated here. Every option has a working default."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

DRAFTERS = ("none", "draft-model", "ngram")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(Section):
    target: str = Field("smollm2-135m", description="Registry name, local model directory, hub id, or tiny-random-<family>[@seed]")
    dtype: Literal["bf16", "fp32", "fp16"] = Field("bf16", description="Weight and activation dtype")
    device: str = Field("auto", description="auto (CUDA when present, else CPU), cpu, cuda, cuda:N")
    threads: int | None = Field(None, description="CPU threads for torch; null keeps torch's default")


class NgramConfig(Section):
    min_n: int = Field(1, ge=1, description="Shortest suffix n-gram to look up")
    max_n: int = Field(3, ge=1, description="Longest suffix n-gram to look up (tried first)")
    max_len: int = Field(8, ge=1, description="Most tokens proposed from one match")


class SpeculationConfig(Section):
    drafter: Literal[DRAFTERS] = Field("ngram", description="Drafting method; none decodes plainly")
    draft_model: str | None = Field(None, description="The draft-model drafter's model (same tokenizer as the target)")
    gamma_max: int = Field(5, ge=1, le=32, description="Most draft tokens per step")
    gamma: int | None = Field(None, ge=0, description="Fixed gamma; null lets the controller choose from measurements")
    max_speculative_batch: int = Field(16, ge=0, description="Batches larger than this always decode plainly")
    ngram: NgramConfig = Field(default_factory=NgramConfig, description="n-gram / prompt-lookup settings")


class ServerConfig(Section):
    host: str = Field("127.0.0.1", description="Address to bind")
    port: int = Field(8000, description="Port to bind")
    served_model_name: str | None = Field(None, description="Model name clients use; defaults to the target's name")
    max_batch_size: int = Field(8, ge=1, description="Most sequences decoded together")
    max_queue: int = Field(64, ge=1, description="Requests waiting beyond this get 429")
    max_model_len: int | None = Field(None, description="Context limit; defaults to the model's own")
    shutdown_grace_s: float = Field(30.0, ge=0, description="On SIGTERM, how long in-flight requests may finish")


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The target model")
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig, description="Drafting and control")
    server: ServerConfig = Field(default_factory=ServerConfig, description="HTTP server and scheduler")

    @classmethod
    def load(cls, path: str | Path) -> "Config":
        """Read and validate a YAML config; errors name the file and the bad field."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist (see configs/ for examples)")
        data = yaml.safe_load(path.read_text()) or {}
        try:
            return cls.model_validate(data)
        except Exception as exc:
            raise ValueError(f"invalid config {path}: {exc}") from exc
