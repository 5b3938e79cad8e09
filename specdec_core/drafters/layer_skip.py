"""Layer skip (self-speculative decoding): the target's first k layers, its final norm and its
output layer draft for the whole target. No second model, no second cache, no re-prefill.

The design. The target's cache holds every token of a row but the last, and
its layers 0..k-1 hold exactly the keys and values the draft needs for all of
them. So the draft runs the first k decoder layers itself
(`ModelRunner.forward_layers`) against the engine's own `BatchCache`: the
first draft pass feeds the row's last token, each later pass the draft token
before. Their keys and values are appended to layers 0..k-1 only, as pending
slots that only the draft's own mask sees. When the proposal is done
(returned or raised), `drop_pending` cuts those layers back to the cache's
slot count, a view and no copy, so the target's verify pass finds its cache
exactly as it left it: every layer the same slot count, one mask for all.

This is simpler than keeping draft slots in the cache through verification
(zero-padded in layers k..L-1, masked out of the target's view, dropped at
commit): nothing of the draft outlives `propose`, so rollback has nothing to
undo and `accepted` is the base class's no-op. The price is that the verify
pass recomputes layers 0..k-1 for the tokens the draft already ran through
them; reusing that work (LayerSkip, Elhoushi et al. 2024) would save up to
k/L of a verify pass, at the cost of a verify forward that starts at layer k
from the draft's hidden states.

Models not trained for early exit (Llama, Qwen2 as released) predict poorly
from their early layers, so acceptance climbs only near the top layers; the
calibration (`python -m specdec_tools.calibrate`) measures where, if anywhere,
that pays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..models.loading import reducible, target_vocab
from ..models.runner import BatchCache, ModelRunner
from ..models.static_runner import StaticRunner, UnsupportedModel
from ..models.vocab import ReducedVocab
from ..sequence import Sequence
from .base import DrafterBuilder, Proposal
from .draft_model import ModelDrafter

if TYPE_CHECKING:
    from ..config import Config

FAMILIES = ("llama", "qwen2")  # decoders whose layers `forward_layers` can run one by one


class LayerSkipDrafter(ModelDrafter):
    """The target's first k layers draft, from the target's own cache."""

    def __init__(self, target: ModelRunner, k: int, vocab: ReducedVocab | None = None, early_exit: float = 0.0):
        if target.config.model_type not in FAMILIES:
            raise ValueError(f"layer-skip runs {', '.join(FAMILIES)} decoders, not {target.config.model_type}")
        if isinstance(target, StaticRunner):
            raise UnsupportedModel("layer-skip drafts in the eager step's slot cache; set model.step: eager")
        if not 1 <= k <= target.num_layers:
            raise ValueError(f"layer-skip k={k}: the target has {target.num_layers} layers; choose 1 <= k <= {target.num_layers}")
        super().__init__(target.vocab_size, vocab, early_exit)
        self.target = target
        self.k = k
        output = target.model.get_output_embeddings()
        self.head = vocab.head(output) if vocab else output  # the target's own output layer unless reduced
        self.cache: BatchCache | None = None  # the engine's target cache, not a copy (attach)

    def attach(self, cache: BatchCache) -> None:
        self.cache = cache

    def propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        try:
            return super().propose(seqs, gamma)
        finally:
            # The draft's slots must never reach the target's verify pass.
            self.cache.drop_pending()

    def _first_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        # The cache lacks only each row's last token: it is the first one to feed.
        return self._next_logits(torch.tensor([[seq.tokens[-1]] for seq in seqs]))

    @torch.no_grad()
    def _next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.target.forward_layers(self.cache, tokens, self.k)
        return self.head(hidden[:, -1]).float()


def default_k(num_layers: int) -> int:
    """k when the config leaves it null."""
    return max(3 * num_layers // 4, 1)


def from_config(config: Config, target: ModelRunner, build: DrafterBuilder) -> LayerSkipDrafter:
    """Layer skip over `target` with speculation.layer_skip's k."""
    spec = config.speculation
    k = spec.layer_skip.k or default_k(target.num_layers)
    return LayerSkipDrafter(target, k, reducible(target_vocab(target, spec.vocab_size), target.model), spec.early_exit)
