"""Where the policy lives while it trains: in this process, or on data-parallel ranks.

The trainer talks to one small interface, whatever `batch.world_size` is:

    engine = open_engine(EngineSpec(...))    # weights directory + optimizer state (None: fresh)
    metrics = engine.step(updates, seed)     # a train step: `batching.plan_updates` plans, `epochs` passes
    engine.state_dict()                      # CPU copy of the weights: what is published
    engine.save_train_state(directory)       # weights + optimizer, a file per rank: what recovery needs
    engine.evaluate(fn)                      # fn(policy) on the live weights (e.g. the probe)
    engine.close()

`LocalEngine` (world_size 1) holds the model in this process (on cuda:0 when there is a GPU);
`RankEngine` drives a group of data-parallel ranks that stay alive for as long as the engine does
(one run, until a restore): forked on this host (`rl.distributed.DataParallelGroup`), or launched by
torchrun on this host and others (`rl.torchrun.TorchrunGroup`, when the trainer worker is set up
so). Both engines build the policy, its optimizer and, when loss.kl_coef > 0, the frozen reference
model (the run's base model, loaded once) from the same factories below, so the paths cannot drift
apart.

Randomness: before every step torch is reseeded from (optim.seed, step) (and the rank), so a step
replayed after a restart draws the same numbers as the original and no generator state needs to
be checkpointed. (The policies we train use no dropout; this keeps replay exact if one does.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from rlpipe.rl.batching import StepPlan
from rlpipe.rl.distributed import DataParallelGroup, RankGroup, cpu_copy
from rlpipe.rl.step import WithOutputLayer, make_optimizer, train_updates
from rlpipe.rl.torchrun import TorchrunGroup, TorchrunRanks
from rlpipe.rl.train_state import load_train_state, save_train_state
from rlpipe.schemas.algorithm import LossConfig, OptimConfig, Precision

T = TypeVar("T")
STEPS_PER_SEED = 1_000_000
"""`step_seed` keeps the seeds of one run's steps distinct for runs of fewer steps than this."""


def step_seed(base_seed: int, step: int) -> int:
    """The seed of optimiser step `step`: a pure function of the config and the step number."""
    return base_seed * STEPS_PER_SEED + step


def load_policy(weights_dir: Path, activation_checkpointing: bool = False) -> nn.Module:
    """The policy from a complete model directory (the base model or a published checkpoint):
    fp32, train mode. Tied weights, which checkpoints store once, are re-tied from the config.
    `activation_checkpointing`: each decoder layer recomputed in the backward pass (train mode only)."""
    model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=torch.float32).train()
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def load_reference(base_dir: Path) -> nn.Module:
    """The frozen reference of the KL penalty: the run's base model, in eval mode, no gradients."""
    return load_policy(base_dir).eval().requires_grad_(False)


def compute_in(model: nn.Module, precision: Precision) -> nn.Module:
    """`model` whose forward passes (its output layer's alone too: the chunked logits call it) run
    under autocast in bf16: matmuls in bf16 over the fp32 weights, which stay the optimizer's master
    copy; the backward pass follows the forward's dtypes. fp32: `model` unchanged. (Ranks compute in
    bf16 through FSDP2's mixed-precision policy instead, rl/distributed.shard, which rounds the
    gathered parameters themselves, norms and embedding included: the two round differently.)"""
    if precision == "bf16":
        device_type = next(model.parameters()).device.type
        for module in (model, cast(WithOutputLayer, model).get_output_embeddings()):
            module.forward = torch.autocast(device_type, dtype=torch.bfloat16)(module.forward)
    return model


@dataclass(frozen=True)
class EngineSpec:
    """What an engine starts from."""

    base_dir: Path                        # the run's base model: the reference of the KL penalty
    weights_dir: Path                     # the weights to start from (base_dir for version 0)
    optimizer_state: dict[str, Any] | None  # a full optimizer state (recovery states of old); None: fresh
    loss: LossConfig
    optim: OptimConfig
    world_size: int
    epochs: int = 1                       # passes over a step's mini-batches (batch.epochs)
    activation_checkpointing: bool = False  # batch.activation_checkpointing
    precision: Precision = "fp32"         # batch.precision
    ranks: TorchrunRanks | None = None    # the trainer worker's: ranks launched by torchrun; None: forked here
    train_state_dir: Path | None = None   # a recovery state (rl/train_state.py): its weights and optimizer win


class Engine(Protocol):
    def step(self, updates: Sequence[StepPlan], seed: int) -> dict[str, float]:
        """A train step: `epochs` passes over `updates`, one optimiser step per plan; the step's
        metrics (rl/step.combine_updates)."""
        ...

    def state_dict(self) -> dict[str, Tensor]: ...

    def optimizer_state_dict(self) -> dict[str, Any]: ...

    def save_train_state(self, directory: Path) -> None:
        """The recovery state (fp32 weights + optimizer state), one file per rank (rl/train_state.py)."""
        ...

    def evaluate(self, fn: Callable[[nn.Module], T]) -> T:
        """fn(policy) on the live weights; `fn` must pickle (a functools.partial of a module function).
        A sharded engine runs it on every rank (each pass gathers weights from all) and answers rank 0's."""
        ...

    def close(self) -> None: ...


class LocalEngine:
    """The policy, its optimizer and the optional reference in this process."""

    def __init__(self, spec: EngineSpec) -> None:
        self.loss, self.grad_clip, self.epochs = spec.loss, spec.optim.grad_clip, spec.epochs
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = compute_in(load_policy(spec.weights_dir, spec.activation_checkpointing).to(device),
                                spec.precision)
        self.optimizer = make_optimizer(self.model.parameters(), spec.optim)
        if spec.train_state_dir is not None:
            load_train_state(self.model, self.optimizer, spec.train_state_dir)
        elif spec.optimizer_state is not None:
            self.optimizer.load_state_dict(spec.optimizer_state)   # moves the state to the parameters' device
        self.ref_model = compute_in(load_reference(spec.base_dir).to(device), spec.precision) \
            if spec.loss.kl_coef > 0 else None

    def step(self, updates: Sequence[StepPlan], seed: int) -> dict[str, float]:
        torch.manual_seed(seed)   # = rl.distributed's seed * world_size + rank for one rank
        shards = [shard for plan in updates for shard in plan.shards]   # one rank: one shard per update
        return train_updates(self.model, self.optimizer, shards, self.loss, epochs=self.epochs,
                             grad_clip=self.grad_clip, ref_model=self.ref_model)

    def state_dict(self) -> dict[str, Tensor]:
        return cpu_copy(self.model.state_dict())

    def optimizer_state_dict(self) -> dict[str, Any]:
        return cpu_copy(self.optimizer.state_dict())

    def save_train_state(self, directory: Path) -> None:
        save_train_state(self.model, self.optimizer, directory)

    def evaluate(self, fn: Callable[[nn.Module], T]) -> T:
        return fn(self.model)

    def close(self) -> None:
        """Nothing to stop: the model goes with the object."""


class RankEngine:
    """`world_size` persistent data-parallel ranks (rl/distributed.py), each holding a FSDP2 shard
    of the policy, its gradients, its optimizer state and the reference."""

    def __init__(self, spec: EngineSpec) -> None:
        self.loss, self.grad_clip, self.epochs = spec.loss, spec.optim.grad_clip, spec.epochs
        model_fn = functools.partial(load_policy, spec.weights_dir, spec.activation_checkpointing)  # they pickle
        optimizer_fn = functools.partial(make_optimizer, cfg=spec.optim)
        ref_model_fn = functools.partial(load_reference, spec.base_dir) if spec.loss.kl_coef > 0 else None
        self.group: RankGroup = TorchrunGroup(
            spec.world_size, model_fn, optimizer_fn, ranks=spec.ranks, ref_model_fn=ref_model_fn,
            precision=spec.precision,
        ) if spec.ranks is not None else DataParallelGroup(
            spec.world_size, model_fn, optimizer_fn, ref_model_fn=ref_model_fn, precision=spec.precision,
            preload=[__name__],   # torch and transformers, imported once by the fork server
        )
        try:
            if spec.train_state_dir is not None:
                self.group.load_train_state(spec.train_state_dir)
            elif spec.optimizer_state is not None:
                self.group.load_optimizer_state_dict(spec.optimizer_state)
        except BaseException:
            self.group.close()
            raise

    def step(self, updates: Sequence[StepPlan], seed: int) -> dict[str, float]:
        return self.group.train([plan.shards for plan in updates], self.loss, epochs=self.epochs,
                                grad_clip=self.grad_clip, seed=seed)

    def state_dict(self) -> dict[str, Tensor]:
        return self.group.state_dict()

    def optimizer_state_dict(self) -> dict[str, Any]:
        return self.group.optimizer_state_dict()

    def save_train_state(self, directory: Path) -> None:
        self.group.save_train_state(directory)

    def evaluate(self, fn: Callable[[nn.Module], T]) -> T:
        return self.group.call(fn)

    def close(self) -> None:
        self.group.close()


def open_engine(spec: EngineSpec) -> Engine:
    """One process for world_size 1 (no rank processes to start or feed), ranks otherwise; ranks
    always where the trainer's ranks are launched by torchrun (they may live on other hosts)."""
    return LocalEngine(spec) if spec.world_size == 1 and spec.ranks is None else RankEngine(spec)
