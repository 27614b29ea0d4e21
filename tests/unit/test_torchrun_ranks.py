"""The trainer's ranks launched by torchrun: two agents started apart (as two hosts would start
them) meet at a c10d rendezvous on loopback and train, driven through the controller's store, to
the parameters of one process; a rank killed mid-command fails it naming the rank, and the next
group (the trainer's retry) forms again on the same ports with the other host's agent rejoining
on its own. Bad launch settings are refused with the variable named."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from rlpipe.rl.torchrun import TorchrunGroup, TorchrunRanks
from rlpipe.trainer.engine import EngineSpec, LocalEngine, RankEngine
from rlpipe.workers.ranks import ranks_from_env
from tests.conftest import free_port_block
from tests.unit.test_sharded_engine import LAYOUTS, OPTIM, STEPS, flat, model_dir, relative_error, train

__all__ = ["model_dir"]   # the fixture, shared with the forked ranks' tests

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> TorchrunRanks:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # tiny models: a second thread per rank only spins
    port = free_port_block(2)
    return TorchrunRanks(nnodes=2, rendezvous=f"127.0.0.1:{port}", controller_port=port + 1, join_timeout_s=120,
                         dead_after_s=5)


@contextmanager
def other_host(ranks: TorchrunRanks) -> Iterator[subprocess.Popen[bytes]]:
    """`rlpipe worker ranks` as another host runs it, with the trainer's variables."""
    env = {**os.environ, "RLPIPE_TRAINER_RANKS": "torchrun", "RLPIPE_TRAINER_NNODES": str(ranks.nnodes),
           "RLPIPE_TRAINER_RENDEZVOUS": ranks.rendezvous, "RLPIPE_TRAINER_CONTROLLER_PORT": str(ranks.controller_port)}
    joiner = subprocess.Popen([str(Path(sys.executable).parent / "rlpipe"), "worker", "ranks", "--per-host", "1"],
                              env=env, start_new_session=True)
    try:
        yield joiner
    finally:
        os.killpg(joiner.pid, signal.SIGKILL)   # the loop, its agent and that agent's ranks
        joiner.wait()


def open_torchrun(model_dir: Path, ranks: TorchrunRanks, layout: str) -> RankEngine:
    loss, batch = LAYOUTS[layout]
    return RankEngine(EngineSpec(base_dir=model_dir, weights_dir=model_dir, optimizer_state=None, loss=loss,
                                 optim=OPTIM, world_size=2, epochs=batch.epochs,
                                 activation_checkpointing=batch.activation_checkpointing, ranks=ranks))


def test_ranks_of_two_torchrun_agents_train_to_the_parameters_of_one_process(model_dir: Path,
                                                                            ranks: TorchrunRanks) -> None:
    layout = "everything"   # a sharded reference, unequal micro-batch counts, two epochs: every path
    loss, batch = LAYOUTS[layout]
    local = LocalEngine(EngineSpec(base_dir=model_dir, weights_dir=model_dir, optimizer_state=None, loss=loss,
                                   optim=OPTIM, world_size=1, epochs=batch.epochs,
                                   activation_checkpointing=batch.activation_checkpointing))
    single = train(local, 1, layout, range(1, STEPS + 1))
    with other_host(ranks):
        engine = open_torchrun(model_dir, ranks, layout)
        try:
            assert isinstance(engine.group, TorchrunGroup) and len(engine.group.places) == 2
            both = train(engine, 2, layout, range(1, STEPS + 1))
            weights = engine.state_dict()
        finally:
            engine.close()
    assert relative_error(flat(weights), flat(local.state_dict())) < 1e-5
    for a, b in zip(both, single, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)


def _sleep(seconds: float, model: nn.Module) -> None:
    time.sleep(seconds)


def test_a_rank_killed_mid_command_fails_it_by_name_and_the_next_group_forms_again(model_dir: Path,
                                                                                ranks: TorchrunRanks) -> None:
    with other_host(ranks):
        engine = open_torchrun(model_dir, ranks, "token_mean")
        group = engine.group
        assert isinstance(group, TorchrunGroup)
        victim = int(group.places[1].rsplit(" ", 1)[1])
        threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
        with pytest.raises(RuntimeError, match=r"data-parallel ranks? \[?1\b") as failed:
            group.call(functools.partial(_sleep, 60.0))
        assert "died" in str(failed.value)
        engine.close()   # after the abort: nothing left to stop
        with pytest.raises(RuntimeError, match="closed"):
            group.state_dict()
        # the trainer's retry: a new group on the same ports; the other host's agent rejoins by itself
        again = open_torchrun(model_dir, ranks, "token_mean")
        try:
            [metrics] = train(again, 2, "token_mean", range(1, 2))
        finally:
            again.close()
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_ranks_that_cannot_split_over_the_hosts_are_refused_before_any_launch() -> None:
    with pytest.raises(ValueError, match=r"batch.world_size 3 cannot be split over 2 hosts"):
        TorchrunRanks(nnodes=2).ranks_per_host(3)


@pytest.mark.parametrize(("variables", "message"), [
    ({"RLPIPE_TRAINER_RANKS": "mpi"}, "RLPIPE_TRAINER_RANKS='mpi': use fork"),
    ({"RLPIPE_TRAINER_RANKS": "torchrun", "RLPIPE_TRAINER_RENDEZVOUS": "trainer-host"},
     "RLPIPE_TRAINER_RENDEZVOUS: .*use HOST:PORT"),
    ({"RLPIPE_TRAINER_RANKS": "torchrun", "RLPIPE_TRAINER_NNODES": "0"}, "RLPIPE_TRAINER_NNODES: .*greater"),
])
def test_bad_launch_settings_name_the_variable(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str],
                                               message: str) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match=message):
        ranks_from_env()


def test_the_default_launch_forks_the_ranks_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLPIPE_TRAINER_RANKS", raising=False)
    assert ranks_from_env() is None
    monkeypatch.setenv("RLPIPE_TRAINER_RANKS", "torchrun")
    assert ranks_from_env() == TorchrunRanks()
