"""The recovery state the trainer stores beside a published version (trainer/trainer.py TrainState):
what it reads back, in today's format and in the format stored before master weights travelled with it."""

from __future__ import annotations

import io

import torch

from rlpipe.trainer.trainer import TrainState


def round_trip(obj: object) -> dict:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_state_with_master_weights_reads_back_whole() -> None:
    optimizer = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}}, "param_groups": [{"params": [0]}]}
    master = {"w": torch.tensor([0.1234567, 2.0])}
    state = TrainState.read(round_trip(vars(TrainState(optimizer, master))))
    assert state.master_weights is not None and torch.equal(state.master_weights["w"], master["w"])
    assert state.master_weights["w"].dtype == torch.float32
    assert torch.equal(state.optimizer["state"][0]["exp_avg"], torch.ones(2))


def test_a_state_stored_before_master_weights_is_the_optimizer_state_alone() -> None:
    optimizer = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"params": [0], "lr": 1e-6}]}
    state = TrainState.read(round_trip(optimizer))
    assert state.master_weights is None and state.optimizer["param_groups"] == optimizer["param_groups"]
