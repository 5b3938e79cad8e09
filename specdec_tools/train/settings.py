"""Settings of the trainers: plain data, importable without torch (the CLI's parser reads their defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataSettings:
    """What the cached features are made of; any change gives another cache directory."""

    tokens: int = 50_000  # total positions (training and held-out): all the answers, the corpus filling the rest
    seq_len: int = 256  # longest sequence run through the target at once
    prompts: int | None = None  # how many of the prompts to answer; None: all
    answer_tokens: int = 128  # longest answer
    temperature: float = 0.0  # of the answers; 0 is greedy
    heldout_every: int = 20  # one in n sequences of each source (answers, corpus) is held out (5%)
    seed: int = 0


@dataclass(frozen=True)
class AnswerSettings:
    """How the data engine answers its prompts (train/answers.py); a run resumes only with the same."""

    answer_tokens: int = 384  # longest answer: Spec-Bench's first turns are judged at 128-256 tokens
    batch: int = 32  # rows decoded together: 32 answered 1.09x the tokens a second of 16 (32 prompts, 128 tokens)
    shard_prompts: int = 64  # prompts a shard: a stopped run loses at most the shard under way


@dataclass(frozen=True)
class TrainSettings:
    """How Medusa heads are trained (the data is `DataSettings`)."""

    num_heads: int = 4
    num_layers: int = 1
    epochs: int = 2
    batch_size: int = 256  # positions per step
    lr: float = 1e-3
    weight_decay: float = 0.0
    head_decay: float = 0.8  # head i's loss weight is head_decay ** i
    checkpoint_every: int = 100  # steps
    seed: int = 0


@dataclass(frozen=True)
class EagleSettings:
    """How the network is trained (the data is `DataSettings`)."""

    epochs: int = 16  # smollm2-135m on 50k positions: held-out top-1 31% after 6 epochs, 35% after 16
    lr: float = 1e-3
    batch_sequences: int = 8  # sequences per optimizer step (each up to the data's seq_len positions)
    token_weight: float = 0.1  # EAGLE's weight of the token loss against the feature loss
    save_every: int = 50  # batches between checkpoints
    depth: int = 5  # held-out chain length
    seed: int = 0


@dataclass(frozen=True)
class Eagle3Settings:
    """How EAGLE-3's drafter is trained on the depth features (train/eagle3.py)."""

    steps: int = 5  # training-time test's steps: drafts deep (the default gamma_max)
    decay: float = 0.8  # step k's loss weight is decay ** k
    vocab_size: int = 16384  # draft vocabulary: the most frequent tokens of the target's answers
    intermediate_size: int = 3072  # the layer's MLP width: a draft step 0.057-0.068 of the 1.5B's (8960: 0.077-0.086)
    epochs: int = 1
    lr: float = 2e-4  # the peak of the schedule
    warmup: int = 0  # batches of linear warmup to `lr` (SpecForge warms up over 1.5% of its run)
    lr_floor: float = 0.0  # the cosine ends at lr * lr_floor
    batch_sequences: int = 4  # sequences per optimizer step
    noise: float = 0.0  # std of Gaussian noise added to the target's features in training (speculators: 0.05)
    frozen_head: bool = False  # keep the output layer and its norm the target's (rebuilt on load, never saved)
    # Batches are cut from runs of this many batches' sequences sorted by length (1: at random). Padded to its longest,
    # a batch cut at random was a quarter padding (39% of its attention), one cut within 8, 7% (12%): 1.19x positions/s.
    length_window: int = 8
    heldout_every: int = 20  # one prompt in n is held out (by its id)
    heldout_shards: int = 20  # held-out figures read the held-out prompts of the first n features shards: one set for every run
    save_every: int = 50  # batches between checkpoints
    seed: int = 0
    # Forward and backward under bf16 autocast (fp32 weights and optimizer) where the CPU computes bf16 itself: 2.6-3.2x
    # faster than fp32 on an AMD EPYC with AVX-512 BF16 (the same 3 batches alternated twice: 5.5-8.5 against 14.8-25.5
    # s), the same loss to 1e-3; 2.4x slower on a Xeon (Ice Lake) without it, which emulates bf16 (39.7 s a batch
    # against 16.3). The CLI chooses from the CPU's flags (`bf16_native`).
    bf16: bool = True


def bf16_native(flags: frozenset[str]) -> bool:
    """Whether a CPU with `flags` computes bf16 matrix products in hardware (AVX-512 BF16 or AMX): where it does not,
    torch emulates them, slower than fp32."""
    return bool(flags & {"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class DistillSettings:
    """How a student is distilled (the data is `DataSettings`)."""

    k: int  # frozen target layers under the adapter (a layer-skip student; 0 for a draft-model student)
    width: int = 1024  # the adapter's inner width
    epochs: int = 2
    batch_size: int = 256  # positions per step
    lr: float = 1e-3
    weight_decay: float = 0.01  # AdamW's default
    temperature: float = 1.0  # T of the softened distributions
    checkpoint_every: int = 100  # steps
    seed: int = 0
