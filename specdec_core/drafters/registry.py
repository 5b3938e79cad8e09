"""Every drafter by the name configs, the bench and the metrics call it: the one list of drafter names.

An entry names the module of `specdec_core.drafters` whose ``from_config(config, target, build)`` makes
the drafter (`build`: another drafter by name, for the hybrid); build.py looks names up here. A module
is imported only when its drafter is built, so the config validates names, and the CLI builds its
parser, without importing torch (vLLM's model registry keeps its entries lazy for the same reason).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Drafter

NO_DRAFTER = "none"  # what a config names to decode plainly


@dataclass(frozen=True)
class Entry:
    module: str  # the module of specdec_core.drafters with the drafter's from_config
    runs_model: bool = False  # drafts with a model of its own: one the hybrid can fall back on


REGISTRY: dict[str, Entry] = {
    "draft-model": Entry("draft_model", runs_model=True),
    "ngram": Entry("ngram"),
    "suffix": Entry("suffix"),
    "layer-skip": Entry("layer_skip", runs_model=True),
    "quantized": Entry("quantized", runs_model=True),
    "hybrid": Entry("hybrid"),
    "medusa": Entry("medusa"),
    "eagle": Entry("eagle"),
    "eagle3": Entry("eagle3", runs_model=True),
    "distilled": Entry("distilled"),
}
DRAFTERS = (NO_DRAFTER, *REGISTRY)  # every name speculation.drafter may give
MODEL_DRAFTERS = tuple(name for name, entry in REGISTRY.items() if entry.runs_model)  # the hybrid's choices


def factory(name: str) -> Callable[..., Drafter]:
    """The `from_config(config, target, build)` of the drafter registered as `name`."""
    entry = REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    return importlib.import_module(f"{__package__}.{entry.module}").from_config
