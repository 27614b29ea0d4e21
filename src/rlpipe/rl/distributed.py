"""Data-parallel optimisation steps on FSDP2 shards over torch.distributed (gloo on CPU, NCCL when
CUDA is present).

A `RankGroup` is `world_size` rank processes started once: `DataParallelGroup` (below) forks them
on this host, `rl/torchrun.TorchrunGroup` has torchrun launch them on this host and others. Each
rank builds its model, optimizer and optional reference model from the picklable factories it is
given (`RankBuild`), makes its weights equal to rank 0's, and shards them with `fully_shard` (each
decoder layer, then the whole model: the embedding and output layer): a rank holds 1/world_size of
the parameters, gradients and AdamW state. The trainer worker then drives it:

    with DataParallelGroup(2, model_fn, optimizer_fn) as group:
        plan = plan_step(samples, advantage=..., loss=..., batch=BatchConfig(world_size=2), pad_token_id=0)
        metrics = group.step(plan.shards, loss_cfg, grad_clip=1.0, seed=7)  # rank 0's metrics
        weights = group.state_dict()                                 # the full weights, to publish
        group.save_train_state(directory)                            # recovery: each rank writes its shards
        group.load_train_state(directory)                            # a restore, at any world size
        probe = group.call(fn)                                       # fn(model) on every rank; rank 0's answer

In a step every rank runs forward and backward over its own micro-batches (rl/step.py); FSDP
gathers each layer's weights for its passes and reduce-scatters its gradients afterwards, averaged
over the ranks (each loss share carries x world_size, see rl/losses.py, so the average is exactly
the full-batch gradient). The metric totals are all-reduced, and every rank clips by the global
norm and steps its shard. Because each pass is a collective, every rank must run the same passes:
shards get as many micro-batches as the longest (empty ones added), a rank forwards a zero-loss
filler for each empty micro-batch, and `call` runs on every rank.

The weights a checkpoint publishes are gathered whole onto rank 0. The recovery state is not:
each rank writes its own shards of the weights and AdamW's state (rl/train_state.py), which load
back at any world size. (`optimizer_state_dict` and `load_optimizer_state_dict` move a full
optimizer state keyed by parameter index, as `optimizer.state_dict()` has it: how recovery states
were stored before, still restored.)
A step given a seed reseeds rank r's torch generator with seed * world_size + r first, so a
replayed step draws the same random numbers. A failure on any rank closes the group and raises
in the caller with that rank's traceback. With NCCL, a rank uses its host's GPU number LOCAL_RANK
(r when forked), so a host's ranks must not outnumber its GPUs.

`DataParallelGroup`'s ranks are forked from a fork server (torch.multiprocessing 'forkserver'), not spawned: the server
is started by the first group of a process and imports torch, this module and the group's
`preload` modules once, so every later group (a restore, the next run) starts in about half a
second instead of importing torch and transformers again in every rank (~6 CPU-seconds each).
The server never touches CUDA, so forking from it is as safe as spawning.
"""

import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Self, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rlpipe.rl.batch import TrainBatch, collate
from rlpipe.rl.step import (
    MetricTotals,
    accumulate_gradients,
    apply_gradients,
    run_epochs,
)
from rlpipe.rl.train_state import load_train_state, save_train_state
from rlpipe.schemas.algorithm import LossConfig, Precision

ModelFn = Callable[[], nn.Module]
"""Builds a model on CPU, e.g. functools.partial(LlamaForCausalLM.from_pretrained, path); must pickle."""
OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""Builds the optimizer over the given parameters, e.g. functools.partial(make_optimizer, cfg=optim)."""


@dataclass(frozen=True)
class Command:
    kind: Literal["train", "state_dict", "optimizer_state_dict", "load_state_dict", "load_optimizer_state_dict",
                  "save_train_state", "load_train_state", "call", "close"]
    """A method of `_Rank` (or close)."""
    payload: Any = None


def cpu_copy(tree: Any) -> Any:
    """A detached CPU copy of every tensor in nested dicts/lists/tuples (a state_dict, an
    optimizer state); other leaves are kept. Copies never alias the live model's storage."""
    if isinstance(tree, Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: cpu_copy(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(cpu_copy(v) for v in tree)
    return tree


def reduce_totals(totals: MetricTotals, device: torch.device) -> None:
    """All-reduce a step's metric totals in place: sums add, maxima take the max, minima the min."""
    ops = ((totals.sums, dist.ReduceOp.SUM), (totals.maxes, dist.ReduceOp.MAX), (totals.mins, dist.ReduceOp.MIN))
    for values, op in ops:
        keys = sorted(values)                                                 # same order on every rank
        packed = torch.stack([values[k] for k in keys]).to(device)           # (K,) float64
        dist.all_reduce(packed, op=op)
        values.update(zip(keys, packed.cpu().unbind(), strict=True))


def _broadcast_module(module: nn.Module) -> None:
    """Make every rank's weights (and buffers) equal to rank 0's."""
    with torch.no_grad():
        for t in module.state_dict().values():
            dist.broadcast(t, src=0)


def shard(model: nn.Module, precision: Precision = "fp32") -> None:
    """FSDP2 in place: each decoder layer its own unit (gathered for its passes, then freed), then
    the whole model (the embedding, final norm and output layer, kept gathered from forward to
    backward). bf16: the gathered weights are bf16 copies of the fp32 shards, which the optimizer
    steps, and gradients are reduced in fp32."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    for layer in getattr(getattr(model, "model", None), "layers", []):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Whole tensors, gathered onto rank 0's CPU (the other ranks get empty dicts)."""


def optimizer_state_by_name(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A single-process optimizer state (keyed by parameter index) keyed by parameter name, as
    torch.distributed's state-dict functions take it; `names` in the order of `model.parameters()`."""
    return {"state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def optimizer_state_by_index(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of `optimizer_state_by_name`: the format `optimizer.state_dict()` has."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


@dataclass
class _Rank:
    """One rank's shards of the model, its optimizer and the optional frozen reference; each method
    serves one command kind and returns rank 0's answer (other ranks return None). Every rank runs
    every command: their collectives need all ranks."""

    rank: int
    world_size: int
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    ref_model: nn.Module | None

    def train(self, payload: tuple[Sequence[Sequence[TrainBatch]], LossConfig, int, float | None, int | None]) -> Any:
        """`epochs` passes over this rank's shard of each update, one optimiser step per update."""
        updates, cfg, epochs, grad_clip, seed = payload
        if seed is not None:
            torch.manual_seed(seed * self.world_size + self.rank)   # distinct per rank, same on replay
        metrics = run_epochs(self.model, updates, cfg, epochs, lambda shard: self._update(shard, cfg, grad_clip),
                             lockstep=True)
        return self._rank0(metrics)

    def _update(self, shard: Sequence[TrainBatch], cfg: LossConfig, grad_clip: float | None) -> dict[str, float]:
        self.model.zero_grad(set_to_none=True)
        totals = accumulate_gradients(self.model, shard, cfg, self.ref_model, lockstep=True)  # reduce-scattered
        reduce_totals(totals, self.device)
        grad_norm = apply_gradients(self.model, self.optimizer, grad_clip)   # by the global norm, on every rank
        return totals.summary(shard[0].stats, grad_norm)

    def state_dict(self, _: None) -> Any:
        return self._rank0(get_model_state_dict(self.model, options=FULL))

    def optimizer_state_dict(self, _: None) -> Any:
        state = get_optimizer_state_dict(self.model, self.optimizer, options=FULL)
        return optimizer_state_by_index(state, self._names()) if self.rank == 0 else None  # others got {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        # private copies: tensors sent through the queues live in shared memory that every rank maps,
        # and the loader writes its shards into the dict it is given
        set_model_state_dict(self.model, cpu_copy(state), options=StateDictOptions(full_state_dict=True))

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state_by_name(cpu_copy(state), self._names()),
                                 options=StateDictOptions(full_state_dict=True))

    def save_train_state(self, directory: str) -> None:
        save_train_state(self.model, self.optimizer, Path(directory))

    def load_train_state(self, directory: str) -> None:
        load_train_state(self.model, self.optimizer, Path(directory))

    def call(self, fn: Callable[[nn.Module], Any]) -> Any:
        return self._rank0(fn(self.model))

    def _names(self) -> list[str]:
        return [name for name, _ in self.model.named_parameters()]

    def _rank0(self, answer: Any) -> Any:
        return answer if self.rank == 0 else None


@dataclass(frozen=True)
class RankBuild:
    """What every rank builds its state from (it pickles: torchrun ranks get it through a store)."""

    world_size: int
    model_fn: ModelFn
    optimizer_fn: OptimizerFn
    ref_model_fn: ModelFn | None
    precision: Precision
    timeout_s: float   # bounds every collective


def build_rank(rank: int, local_rank: int, build: RankBuild, init_method: str) -> _Rank:
    """Join the process group, build the model, make its weights equal to rank 0's and shard it.
    `local_rank`: this rank's place on its host (its GPU with NCCL)."""
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=init_method, rank=rank,
                            world_size=build.world_size, timeout=timedelta(seconds=build.timeout_s))
    model = build.model_fn().to(device)
    _broadcast_module(model)
    shard(model, build.precision)
    optimizer = build.optimizer_fn(model.parameters())   # over the shards: each rank steps its own
    ref_model = build.ref_model_fn().to(device) if build.ref_model_fn is not None else None
    if ref_model is not None:
        ref_model.requires_grad_(False)
        _broadcast_module(ref_model)
        shard(ref_model, build.precision)
    return _Rank(rank, build.world_size, device, model, optimizer, ref_model)


def serve(rank: _Rank, next_command: Callable[[], Command], answer: Callable[[str, Any], None]) -> None:
    """Run commands until 'close', answering each: ("ok", rank 0's result) or ("error", traceback)."""
    while (cmd := next_command()).kind != "close":
        try:
            answer("ok", getattr(rank, cmd.kind)(cmd.payload))
        except Exception:
            answer("error", traceback.format_exc())
    dist.destroy_process_group()


def _forked_rank_main(rank: int, build: RankBuild, init_file: str, inbox: "mp.Queue[Command]",
                      outbox: "mp.Queue[tuple[int, str, Any]]") -> None:
    """One forked rank: build, then serve commands until 'close'. Every command is answered on `outbox`."""
    parent = os.getppid()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // build.world_size))  # the host's cores, shared
    try:
        rank_state = build_rank(rank, rank, build, f"file://{init_file}")
        outbox.put((rank, "ok", None))
    except Exception:
        outbox.put((rank, "error", traceback.format_exc()))
        return
    serve(rank_state, lambda: _next_command(inbox, parent), lambda status, result: outbox.put((rank, status, result)))


def _next_command(inbox: "mp.Queue[Command]", parent: int) -> Command:
    """The next command, or 'close' once the parent has died (so that an orphaned rank exits)."""
    while True:
        try:
            return inbox.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:
                return Command("close")


def _same_length(shards: Sequence[Sequence[TrainBatch]]) -> list[list[TrainBatch]]:
    """Each rank's micro-batches, padded with empty ones to the longest rank's count (lockstep)."""
    longest = max(len(s) for s in shards)
    return [[*s, *[collate([], s[0].stats, pad_token_id=0)] * (longest - len(s))] for s in shards]


class RankGroup:
    """`world_size` rank processes holding the shards of one model, driven from this process (see
    the module docstring). How the ranks are started and reached is the subclass's: forked here
    (`DataParallelGroup`), or launched by torchrun on several hosts (rl/torchrun.py)."""

    world_size: int

    def step(
        self, shards: Sequence[Sequence[TrainBatch]], cfg: LossConfig, *, grad_clip: float | None,
        seed: int | None = None,
    ) -> dict[str, float]:
        """One optimisation step: rank r trains on `shards[r]` (from `batching.plan_step`); rank 0's
        metrics. `seed` (None: leave the generators alone) makes the step's randomness replayable."""
        return self.train([shards], cfg, epochs=1, grad_clip=grad_clip, seed=seed)

    def train(
        self, updates: Sequence[Sequence[Sequence[TrainBatch]]], cfg: LossConfig, *, epochs: int,
        grad_clip: float | None, seed: int | None = None,
    ) -> dict[str, float]:
        """`epochs` passes over `updates` (each the shards of one mini-batch, from `batching.plan_updates`),
        one optimisation step per update; rank 0's metrics (rl/step.combine_updates)."""
        for shards in updates:
            if len(shards) != self.world_size or any(not s for s in shards):
                raise ValueError(
                    f"step needs {self.world_size} shards of at least one micro-batch each (plan_step makes them)"
                )
            if any(mb.stats.world_size != self.world_size for s in shards for mb in s):
                raise ValueError(f"the micro-batches were planned for another world size: plan with "
                                 f"batch.world_size={self.world_size}")
        updates = [_same_length(shards) for shards in updates]
        commands = [Command("train", ([list(shards[rank]) for shards in updates], cfg, epochs, grad_clip, seed))
                    for rank in range(self.world_size)]
        return cast(dict[str, float], self._send(commands))  # answers arrive pickled, untyped

    def state_dict(self) -> dict[str, Tensor]:
        """The full model weights, gathered onto the CPU."""
        return cast(dict[str, Tensor], self._broadcast(Command("state_dict")))

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The full optimizer state, gathered onto the CPU, keyed by parameter index (as `optimizer.state_dict()`)."""
        return cast(dict[str, Any], self._broadcast(Command("optimizer_state_dict")))

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load full weights, each rank keeping its shard (the optimizer state is kept)."""
        self._broadcast(Command("load_state_dict", state))

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Load a full optimizer state (`optimizer_state_dict`'s format, e.g. from a checkpoint), sharded."""
        self._broadcast(Command("load_optimizer_state_dict", state))

    def save_train_state(self, directory: Path) -> None:
        """Every rank writes its shards of the weights and optimizer state into `directory`
        (rl/train_state.py: one file per rank, loadable at any world size). Ranks on other hosts
        write into the same path on theirs: it must be one shared directory."""
        self._broadcast(Command("save_train_state", str(directory)))

    def load_train_state(self, directory: Path) -> None:
        """Load a state `save_train_state` wrote, at this or any other world size."""
        self._broadcast(Command("load_train_state", str(directory)))

    def call(self, fn: Callable[[nn.Module], Any]) -> Any:
        """fn(model) on every rank (the sharded model's passes need them all); rank 0's answer, e.g. an
        evaluation of the live weights. `fn` must pickle (a module-level function or a functools.partial
        of one), should not change the model, and must run the same passes on every rank."""
        return self._broadcast(Command("call", fn))

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _broadcast(self, cmd: Command) -> Any:
        """Send `cmd` to every rank; rank 0's answer."""
        return self._send([cmd] * self.world_size)

    def _send(self, commands: Sequence[Command]) -> Any:
        """Send rank r `commands[r]`, wait for every rank's answer and return rank 0's; a rank's
        error or death closes the group and raises RuntimeError naming the rank."""
        raise NotImplementedError


class DataParallelGroup(RankGroup):
    """The ranks forked on this host from a fork server (the module docstring says why), reached
    through multiprocessing queues; they meet through a file rendezvous in a private directory."""

    def __init__(
        self,
        world_size: int,
        model_fn: ModelFn,
        optimizer_fn: OptimizerFn,
        *,
        ref_model_fn: ModelFn | None = None,
        precision: Precision = "fp32",
        timeout_s: float = 1800.0,
        preload: Sequence[str] = (),
    ) -> None:
        """Start the ranks and wait until each has built its model; `timeout_s` bounds every command.
        `precision`: the passes' compute dtype (`shard`).
        `preload`: modules the fork server imports (those the factories need, e.g. the model's
        library); it counts only while this process has no fork server yet (the first group)."""
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["__main__", __name__, *preload])
        self.world_size = world_size
        self._timeout_s = timeout_s
        self._dir = tempfile.mkdtemp(prefix="rlpipe-dp-")   # the file rendezvous: no port to pick
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        build = RankBuild(world_size, model_fn, optimizer_fn, ref_model_fn, precision, timeout_s)
        self._procs = [
            ctx.Process(target=_forked_rank_main, daemon=True,
                        args=(rank, build, os.path.join(self._dir, "rendezvous"), self._inboxes[rank], self._outbox))
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect()

    def close(self) -> None:
        """Stop the ranks and remove the rendezvous directory; safe to call twice."""
        for p, inbox in zip(self._procs, self._inboxes, strict=True):
            if p.is_alive():
                inbox.put(Command("close"))
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _send(self, commands: Sequence[Command]) -> Any:
        for inbox, cmd in zip(self._inboxes, commands, strict=True):
            inbox.put(cmd)
        return self._collect()

    def _collect(self) -> Any:
        """Wait for one answer from every rank; return rank 0's. Any error or death closes the group."""
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + self._timeout_s
        while len(answers) < self.world_size:
            try:
                rank, status, payload = self._outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in answers]
                if dead or time.monotonic() > deadline:
                    self._abort()
                    raise RuntimeError(f"data-parallel ranks {dead or 'all'} died or timed out") from None
                continue
            if status == "error":
                self._abort()
                raise RuntimeError(f"data-parallel rank {rank} failed:\n{payload}")
            answers[rank] = payload
        return answers[0]

    def _abort(self) -> None:
        """Kill the ranks at once: a rank may be blocked in a collective its failed peer never joins."""
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join()
        shutil.rmtree(self._dir, ignore_errors=True)
