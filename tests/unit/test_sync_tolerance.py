"""The verification bound of a sync from the dtype its server computes in (weights/tolerance.py), and
which greedy tokens of the probe a server within that bound must reproduce (weights/sync.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.weights.sync import SyncPlan, Weights, _inconclusive, comparable_greedy_tokens
from rlpipe.weights.tolerance import BF16_SERVER_TOLERANCE, FP32_SERVER_TOLERANCE, UnmeasuredDtype, probe_tolerance


def test_an_fp32_server_is_held_to_fp32_noise_and_a_bf16_one_to_its_own_rounding() -> None:
    assert probe_tolerance("float32") == FP32_SERVER_TOLERANCE == 2e-4
    assert probe_tolerance("bfloat16") == BF16_SERVER_TOLERANCE
    # measured (benchmarks/sync_precision.py): faithful bf16 loads of SmolLM2 reach 0.34, a wrong layer 7.5
    assert 0.34 < BF16_SERVER_TOLERANCE < 7.5


def test_a_server_dtype_nobody_measured_is_named() -> None:
    assert probe_tolerance("float16") == BF16_SERVER_TOLERANCE   # rounds finer than bf16: covered
    with pytest.raises(UnmeasuredDtype, match="'float8_e4m3fn'.*float32, bfloat16, float16.*sync.verify_tolerance"):
        probe_tolerance("float8_e4m3fn")


def test_greedy_tokens_are_compared_up_to_the_first_near_tie() -> None:
    probe = {"greedy_ids": [5, 6, 7, 8], "greedy_margins": [3.0, 0.5, 0.01, 2.0]}
    assert comparable_greedy_tokens(probe, tolerance=1e-4) == 4       # fp32: no near-tie
    assert comparable_greedy_tokens(probe, tolerance=0.1) == 2        # the third token is a coin toss at 0.1
    assert comparable_greedy_tokens(probe, tolerance=1.0) == 1
    assert comparable_greedy_tokens(probe, tolerance=3.0) == 0
    assert comparable_greedy_tokens({"greedy_ids": [5, 6]}, tolerance=0.1) == 2   # recorded without margins


def plan(new: dict, old: dict, tolerance: float) -> SyncPlan:
    return SyncPlan(2, Path("v2"), new, "verifying-2", Weights("1", Path("v1"), "run", 1, old), "wait", tolerance)


def probe(logprobs: list[float], greedy: list[int], margins: list[float]) -> dict:
    return {"token_ids": [1, 2, 3], "logprobs": logprobs, "greedy_ids": greedy, "greedy_margins": margins}


def test_a_check_is_inconclusive_only_where_neither_logprobs_nor_compared_greedy_tokens_moved() -> None:
    before = probe([-1.0, -2.0], [5, 6, 7], [3.0, 0.5, 2.0])
    small = probe([-1.1, -2.0], [5, 6, 7], [3.0, 0.5, 2.0])          # moved 0.1
    assert _inconclusive(plan(small, before, tolerance=1.0)) is not None   # a bf16 server cannot tell them apart
    assert _inconclusive(plan(small, before, tolerance=2e-4)) is None      # an fp32 one can
    # the greedy continuation changed at its third token, after a near-tie at a bound of 1.0: not compared
    late = probe([-1.1, -2.0], [5, 6, 9], [3.0, 0.5, 2.0])
    assert _inconclusive(plan(late, before, tolerance=1.0)) is not None
    early = probe([-1.1, -2.0], [4, 6, 7], [3.0, 0.5, 2.0])            # the first, compared token changed
    assert _inconclusive(plan(early, before, tolerance=1.0)) is None
