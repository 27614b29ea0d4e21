"""The verification bound of a sync from the dtype its server computes in (weights/tolerance.py), and
which greedy tokens of the probe a server within that bound must reproduce (weights/sync.py)."""

from __future__ import annotations

import pytest

from rlpipe.weights.sync import comparable_greedy_tokens
from rlpipe.weights.tolerance import BF16_SERVER_TOLERANCE, FP32_SERVER_TOLERANCE, probe_tolerance


def test_an_fp32_server_is_held_to_fp32_noise_and_a_bf16_one_to_its_own_rounding() -> None:
    assert probe_tolerance("float32") == FP32_SERVER_TOLERANCE == 2e-4
    assert probe_tolerance("bfloat16") == BF16_SERVER_TOLERANCE
    # measured (benchmarks/sync_precision.py): faithful bf16 loads of SmolLM2 reach 0.34, a wrong layer 7.5
    assert 0.34 < BF16_SERVER_TOLERANCE < 7.5


def test_a_server_dtype_nobody_measured_is_named() -> None:
    with pytest.raises(ValueError, match="'float16'.*float32 and bfloat16.*sync.verify_tolerance"):
        probe_tolerance("float16")


def test_greedy_tokens_are_compared_up_to_the_first_near_tie() -> None:
    probe = {"greedy_ids": [5, 6, 7, 8], "greedy_margins": [3.0, 0.5, 0.01, 2.0]}
    assert comparable_greedy_tokens(probe, tolerance=1e-4) == 4       # fp32: no near-tie
    assert comparable_greedy_tokens(probe, tolerance=0.1) == 2        # the third token is a coin toss at 0.1
    assert comparable_greedy_tokens(probe, tolerance=2.0) == 0
    assert comparable_greedy_tokens({"greedy_ids": [5, 6]}, tolerance=0.1) == 2   # recorded without margins
