"""EAGLE-3 drafting (Li et al. 2025): the EAGLE drafter (eagle.py) over EAGLE-3's network, which reads the target's
hidden states at a low, a middle and a high layer and drafts over its own reduced vocabulary. A chain by default
(top_k 1): on a CPU every verified node costs, so a tree must earn its width by measurement."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..models.artifacts import EAGLE3
from ..models.eagle3_net import load_eagle3
from .base import DrafterBuilder
from .eagle import EagleDrafter

if TYPE_CHECKING:
    from ..config import Config
    from ..models.runner import ModelRunner


def from_config(config: Config, target: ModelRunner, build: DrafterBuilder) -> EagleDrafter:
    """speculation.eagle3's trained drafter over `target`; weights not trained yet raise MissingArtifactError,
    which names the command that trains them."""
    settings = config.speculation.eagle3
    precision = None if settings.precision == "bf16" else settings.precision
    net = load_eagle3(settings.weights or EAGLE3.default(config.model.target), target.model, config.model.target,
                      precision)
    return EagleDrafter(net, settings.top_k, settings.depth, settings.total_tokens)
