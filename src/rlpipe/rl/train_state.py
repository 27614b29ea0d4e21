"""The recovery state of a policy in training: its fp32 weights and its optimizer state, written by
torch.distributed.checkpoint (DCP) as one file per rank plus a `.metadata` index.

Each rank writes only its own shards (nothing is gathered onto one rank), and a state written at
one world size loads at any other, one process included: DCP records where every slice of every
tensor lives, and each rank reads back the slices of its new shards. The tensors are keyed by
parameter name (`get_state_dict`), so the layout of the model in memory (sharded or not) does not
matter. The weights are the master weights the optimizer steps, fp32 whatever the compute dtype or
the dtype of the published checkpoint, so a restore continues exactly where the state was written.

    save_train_state(model, optimizer, directory)   # on every rank, collectively
    load_train_state(model, optimizer, directory)   # into a freshly built model and optimizer
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


@contextmanager
def _alone_is_meant() -> Iterator[None]:
    """Without a process group (one process) DCP reads and writes alone, as meant, and warns each time."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_train_state(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Write the weights and optimizer state into `directory` (every rank of a group calls it)."""
    weights, optimizer_state = get_state_dict(model, optimizer)
    with _alone_is_meant():
        dcp.save({"model": weights, "optimizer": optimizer_state}, checkpoint_id=directory)


def load_train_state(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load what `save_train_state` wrote, at any world size, into `model` and `optimizer`."""
    # the target layout; on a fresh optimizer this creates AdamW's state (a step at lr 0), which
    # the load then overwrites, step counts included
    weights, optimizer_state = get_state_dict(model, optimizer)
    with _alone_is_meant():
        dcp.load({"model": weights, "optimizer": optimizer_state}, checkpoint_id=directory)   # in place
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optimizer_state)
