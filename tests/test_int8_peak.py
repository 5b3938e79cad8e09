"""The int8 peak probe (specdec_tools/int8_peak.cpp) and what step_costs sets against it: every family the CPU runs
does all of its iterations' multiply-adds (the checksum counts them), a peak is measured for each, and a pass's
multiply-adds are its linear layers' (1.54 G a token on the 1.5B). No test asserts a rate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdec_tools import int8_peak, step_costs

from .helpers import tiny_runner

# Each chain's int32 lanes add 4 products of 3 x 5 an instruction (AMX: 64 of them an element), from its index.
LANES = {"avx512_vnni": 16, "avx_vnni": 8, "avx2": 8}


def wrapped(value: int) -> int:
    return (value + 2**31) % 2**32 - 2**31


def checksum(family: str, iterations: int) -> int:
    """What one thread's chains sum to after `iterations`, wrapping as int32 lanes do."""
    if family == "amx_int8":
        return wrapped(4 * 16 * 16 * 64 * 15 * iterations)
    return wrapped(sum(LANES[family] * wrapped(chain + 60 * iterations) for chain in range(12)))


def runs(family: str) -> None:
    if int8_peak.extension() is None:
        pytest.skip("the probe cannot be built here (g++ and ninja)")
    if family not in int8_peak.families():
        pytest.skip(f"this CPU has no {family}")


@pytest.mark.parametrize("family", list(int8_peak.FAMILIES))
def test_each_family_does_every_iterations_multiply_adds(family):
    runs(family)
    for iterations in (1, 1000, 40_000_000 // int8_peak.FAMILIES[family][1] + 1):  # the last wraps the lanes
        seconds, total = int8_peak.chains(family, iterations, 2)
        assert total == 2 * checksum(family, iterations) and seconds > 0


def test_a_peak_is_measured_for_every_family_the_cpu_runs():
    runs("avx2")
    result = int8_peak.peaks(threads=1, seconds=0.01)
    assert result["threads"] == 1 and set(result["g_macs_per_s"]) == set(int8_peak.families())
    assert all(rate > 0 for rate in result["g_macs_per_s"].values())


def test_a_passs_multiply_adds_are_its_linear_layers_and_are_set_against_the_peak():
    shapes = dict(step_costs.SHAPES["qwen2.5-coder-1.5b"])
    config = AutoConfig.for_model(shapes.pop("model_type"), **shapes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layer = 2 * 1536 * 1536 + 2 * 1536 * 256 + 3 * 1536 * 8960
    assert step_costs.linear_macs(model) == 28 * layer + 1536 * 151936  # 1.54 G: the embedding is a lookup
    runner = tiny_runner()
    rates = step_costs.int8_rates(runner, {"static": {1: 2.0, 8: 4.0}}, read_ms=1.0)
    macs = step_costs.linear_macs(runner.model)
    assert rates["macs_per_token"] == macs and rates["g_macs_per_s"]["static"][8] == pytest.approx(macs * 8 / 4.0 / 1e6)
    if rates["of_peak"] is not None:  # where our kernel runs
        peak = rates["peaks"]["g_macs_per_s"][rates["kernel_peak"]]
        assert rates["of_peak"]["static"][8] == pytest.approx(rates["g_macs_per_s"]["static"][8] / peak)
        assert rates["over_bound"]["static"][1] == pytest.approx(2.0 / max(1.0, macs / (0.75 * peak * 1e6)))
