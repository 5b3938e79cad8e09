"""Row-invariant attention (models/attention.py, attention.cpp): close to a float64 reference, and each
query row computes bit for bit what a one-row call computes for it, whatever the pass length (1..64),
the tree, the holes in the cache or the other rows, on the AVX paths and on AMX tiles (where the CPU has
them); then whole passes of a quantized model equal one-token steps, which SDPA's do not."""

from __future__ import annotations

import pytest
import torch

from specdec_core.config import ModelConfig
from specdec_core.models import attention
from specdec_core.models.attention import RowSlots, row_slots
from specdec_core.models.loading import load_runner
from specdec_core.models.runner import BatchCache
from specdec_core.tree import batch_layout

from .helpers import single_thread  # noqa: F401  (autouse: torch on one thread)

HEADS, KV_HEADS, DIM = 6, 2, 40  # GQA groups of 3; 40 = two 16-lane blocks and a tail of 8

pytestmark = pytest.mark.skipif(attention.extension() is None, reason="the attention kernel cannot be built here")


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, tiles: bool = False) -> torch.Tensor:
    slots = row_slots(allowed)
    return attention.extension().attend(query, key, value, slots.slots, slots.offsets, query.shape[-1]**-0.5, tiles)


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention in float64 with a boolean mask: [B, k, H, d]."""
    groups = HEADS // KV_HEADS
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    scores = (query.double() @ k.transpose(-1, -2)) * query.shape[-1]**-0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def pass_of(rows: int, length: int, cached: int, dtype: torch.dtype, seed: int = 0, dim: int = DIM, heads: int = HEADS):
    """query [B, H, k, d] and keys and values [B, Hkv, cached + k, d], with a causal mask over `cached`
    slots of which about a fifth are holes (slots of refused drafts, or of other rows)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, length, heads, dim, generator=generator).to(dtype).transpose(1, 2)  # as transformers has it
    key, value = (torch.randn(rows, KV_HEADS, cached + length, dim, generator=generator).to(dtype) for _ in range(2))
    valid = torch.rand(rows, cached, generator=generator) > 0.2
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = torch.cat([valid[:, None].expand(rows, length, cached), causal.expand(rows, length, length)], dim=2)
    return query, key, value, allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 2, 7, 64])
def test_the_kernel_is_softmax_attention(dtype, length):
    query, key, value, allowed = pass_of(3, length, 50, dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(attend(query, key, value, allowed).double(), reference(query, key, value, allowed),
                               rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_of_a_pass_equals_that_row_alone(dtype):
    """For every pass length 1..64, each query row equals a one-row call over exactly its own keys, laid out
    as a one-token step finds them: dense, no holes, nothing after it."""
    for length in range(1, 65):
        query, key, value, allowed = pass_of(2, length, 30, dtype, seed=length)
        assert_each_row_is_its_own_call(query, key, value, allowed)


def test_a_tree_row_equals_its_path_alone():
    assert_each_row_is_its_own_call(*tree_pass(20, torch.float32))


def assert_each_row_is_its_own_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                                    tiles: bool = False) -> torch.Tensor:
    """Each query row of the pass equals a one-row call over exactly its own keys, laid out as a one-token step
    finds them: dense, no holes, nothing after it. Returns the pass's output."""
    out = attend(query, key, value, allowed, tiles)
    for b in range(query.shape[0]):
        for i in range(query.shape[2]):
            own = allowed[b, i].nonzero().squeeze(1)
            alone = attend(query[b : b + 1, :, i : i + 1], key[b : b + 1, :, own], value[b : b + 1, :, own],
                           torch.ones(1, 1, len(own), dtype=torch.bool), tiles)
            assert torch.equal(out[b, i], alone[0, 0]), (query.shape[2], b, i)
    return out


def tree_pass(cached: int, dtype: torch.dtype, dim: int = DIM, heads: int = HEADS):
    """A tree of 7 nodes after `cached` slots: query, key, value and allowed as pass_of gives them."""
    parents = [-1, -1, 0, 0, 2, 1]
    query, key, value, _ = pass_of(1, len(parents) + 1, cached, dtype, dim=dim, heads=heads)
    mask, _ = batch_layout([parents], len(parents))
    return query, key, value, torch.cat([torch.ones(1, len(parents) + 1, cached, dtype=torch.bool), mask], dim=2)


needs_tiles = pytest.mark.skipif(not attention.tiles_granted(), reason="this CPU has no AMX-BF16 tiles (or SPECDEC_ISA asks for none)")


@needs_tiles
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("length", [1, 7, 64])
def test_the_tiles_are_softmax_attention(dim, length):
    query, key, value, allowed = pass_of(3, length, 50, torch.bfloat16, dim=dim)
    torch.testing.assert_close(attend(query, key, value, allowed, tiles=True).double(), reference(query, key, value, allowed),
                               rtol=2e-2, atol=2e-2)


@needs_tiles
@pytest.mark.parametrize(("heads", "dim", "threads"), [(HEADS, 64, 1), (14, 128, 2)])
def test_each_row_on_the_tiles_equals_that_row_alone(heads, dim, threads):
    """The tile path's row invariance: rows taken together (a causal pass, its slot lists each a prefix of the
    longest's) and tree rows (one at a time) against one-row calls over their own keys, dense; 70 cached slots,
    so that rows end in different blocks of 32. Also with 7 query heads a key head (16 rows' 112 query vectors
    outgrow one round of 6 score tiles), heads of 128 (8 output tiles, two rounds) and two threads. The AVX-512
    path's bits differ (the negative control)."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows_alone_on_the_tiles(heads, dim)
    finally:
        torch.set_num_threads(old_threads)


def rows_alone_on_the_tiles(heads: int, dim: int) -> None:
    """Each row of causal passes of several lengths and of a tree against its one-row call, on the tiles."""
    for length in (1, 2, 15, 16, 17, 33, 64):
        query, key, value, allowed = pass_of(2, length, 70, torch.bfloat16, seed=length, dim=dim, heads=heads)
        out = assert_each_row_is_its_own_call(query, key, value, allowed, tiles=True)
        assert not torch.equal(out, attend(query, key, value, allowed))
    assert_each_row_is_its_own_call(*tree_pass(40, torch.bfloat16, dim=dim, heads=heads), tiles=True)


def test_row_slots_are_each_rows_attended_slots_in_order():
    allowed = torch.tensor([[[1, 0, 1, 0], [1, 0, 1, 1]], [[0, 1, 0, 0], [0, 1, 1, 0]]], dtype=torch.bool)
    slots = row_slots(allowed)
    assert isinstance(slots, RowSlots)
    assert slots.slots.tolist() == [0, 2, 0, 2, 3, 1, 1, 2] and slots.offsets.tolist() == [0, 2, 5, 6, 8]


@pytest.fixture(scope="module")
def int4_target():
    return load_runner("tiny-random-qwen2", ModelConfig(target="tiny-random-qwen2", dtype="fp32", weights="int4", device="cpu"))


def test_only_quantized_cpu_targets_are_row_invariant(int4_target):
    float_target = load_runner("tiny-random-qwen2", ModelConfig(target="tiny-random-qwen2", dtype="fp32", device="cpu"))
    assert int4_target.row_invariant and not float_target.row_invariant


@pytest.mark.parametrize("row_invariant", [True, False])
def test_a_verify_pass_equals_one_token_steps(int4_target, row_invariant):
    """A 12-token pass after a refused one (holes in the cache), beside another row, against 12 one-token
    steps of that row alone: bit-identical logits on the row-invariant path. SDPA's differ (the negative
    control: the comparison can fail)."""
    verify_pass_equals_steps(int4_target, row_invariant)


@needs_tiles
@pytest.mark.parametrize("row_invariant", [True, False])
def test_a_verify_pass_on_the_tiles_equals_one_token_steps(smollm2_dir, row_invariant):
    """The same on the AMX tiles: SmolLM2 int4 in bf16, whose heads of 64 take them (the tiny model's of 16 do not)."""
    runner = load_runner("smollm2-135m", ModelConfig(target="smollm2-135m", dtype="bf16", weights="int4", device="cpu"))
    assert attention.tiles(torch.empty(1, 1, 1, runner.head_dim, dtype=runner.dtype))
    verify_pass_equals_steps(runner, row_invariant)


def verify_pass_equals_steps(runner, row_invariant: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    prompt, other, tokens = (torch.randint(0, runner.vocab_size, (n,), generator=generator).tolist() for n in (40, 25, 12))
    steps = runner.prefill(prompt)[0]
    alone = torch.cat([runner.forward(steps, torch.tensor([[t]]), commit=True, row_invariant=row_invariant)[0][0] for t in tokens])
    batch = BatchCache.empty(runner.device)
    batch.append(runner.prefill(other)[0])
    batch.append(runner.prefill(prompt)[0])
    runner.forward(batch, torch.randint(0, runner.vocab_size, (2, 5), generator=generator), row_invariant=row_invariant)
    batch.commit(torch.tensor([[True] * 5, [False] * 5]))
    ids = torch.stack([torch.randint(0, runner.vocab_size, (12,), generator=generator), torch.tensor(tokens)])
    in_pass = runner.forward(batch, ids, commit=True, row_invariant=row_invariant)[0][1]
    assert torch.equal(in_pass, alone) == row_invariant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_familys_build_computes_the_same_bits(dtype):
    """The avx512 family's build (AVX-512 registers, scores of 16 keys at once) and the avx2 family's (AVX2 ones, 8
    keys at once), each a key at a time past its last whole block, give each row the same bits, at the 1.5B's and
    SmolLM2's head sizes and with a tail past the last 16 lanes, so forcing SPECDEC_ISA changes no text."""
    builds = [attention.family_extension(family) for family in ("avx2", "avx512") if attention.build_runs_here(family)]
    if len(builds) < 2 or None in builds:
        pytest.skip("this CPU runs one kernel family only")
    for dim, length in ((128, 1), (128, 9), (64, 33), (DIM, 7)):  # 70+ keys: blocks of 16 and of 8 meet single keys
        generator = torch.Generator().manual_seed(dim + length)
        query = torch.randn(2, HEADS, length, dim, generator=generator).to(dtype)
        key, value = (torch.randn(2, KV_HEADS, 70 + length, dim, generator=generator).to(dtype) for _ in range(2))
        allowed = torch.rand(2, length, 70 + length, generator=generator) > 0.2
        slots = row_slots(allowed)
        avx2, avx512 = (build.attend(query, key, value, slots.slots, slots.offsets, dim**-0.5, False) for build in builds)
        assert torch.equal(avx2, avx512), (dim, length)


def test_the_attention_build_follows_the_kernel_family_where_this_cpu_runs_it(monkeypatch):
    """SPECDEC_ISA's family chooses the build (the avxvnni family's is the AVX2 one: its attention multiplies no
    bytes); where vnni stands an AVX-512 CPU in for an AVX2 one (the emulated kernel's tests in CI), the attention
    stays on the AVX2 build this CPU runs, not one that would stop it."""
    built = []
    monkeypatch.setattr(attention, "family_extension", lambda family: built.append(family))
    monkeypatch.setattr(attention, "cpu_flags", lambda: {"avx2", "fma"})
    for family, expected in (("avx512", "avx2"), ("avxvnni", "avx2"), ("avx2", "avx2"), (None, None)):
        monkeypatch.setattr(attention.vnni, "family", lambda family=family: family)
        attention.extension()
        assert built[-1] == expected
    monkeypatch.setattr(attention, "cpu_flags", lambda: {"avx512f", "avx2", "fma"})
    monkeypatch.setattr(attention.vnni, "family", lambda: "avx512")
    attention.extension()
    assert built[-1] == "avx512"
