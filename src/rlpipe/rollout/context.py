"""What a worker needs to act for a run, built once per run and cached: its config, environment
and tokenizer. Activities carry only the run id; everything else is looked up here."""

from __future__ import annotations

import json
import socket
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlpipe.envs.base import Environment, Split, Task
from rlpipe.envs.registry import build_environment
from rlpipe.schemas.config import ConfigError, RunConfig
from rlpipe.storage.db import Database
from rlpipe.storage.runs import load_run_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class RunContext:
    config: RunConfig
    env: Environment
    _tokenizer: PreTrainedTokenizerBase | None = None

    @property
    def model_dir(self) -> Path:
        return checked_model_dir(self.config.model.path)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            from rlpipe.policy.chat import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer


def checked_model_dir(path: str) -> Path:
    """`model.path` resolved on this worker, or a ConfigError naming it and what is wrong. Without
    the check a missing or foreign directory fails inside the model loader, and the trainer's
    retry policy (retry until the worker is back) would retry that forever."""
    resolved = Path(path).resolve()
    where = f"model.path '{path}' ({resolved} on {socket.gethostname()})"
    if not resolved.is_dir():
        raise ConfigError(f"{where}: no such directory; prepare one with `rlpipe model prepare`")
    try:
        model_type = json.loads((resolved / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    if not model_type:
        raise ConfigError(f"{where} is not a model directory: no config.json with a model_type")
    if not any(resolved.glob("*.safetensors")):
        raise ConfigError(f"{where} is not a model directory: no *.safetensors weights")
    return resolved


class RunContexts:
    """A small LRU of RunContext by run id (a worker usually serves one or two runs)."""

    def __init__(self, db: Database, capacity: int = 8) -> None:
        self.db = db
        self.capacity = capacity
        self._cache: OrderedDict[str, RunContext] = OrderedDict()

    def get(self, run_id: str) -> RunContext:
        if run_id in self._cache:
            self._cache.move_to_end(run_id)
            return self._cache[run_id]
        with self.db.begin() as s:
            config = load_run_config(s, run_id)
        try:
            env = build_environment(config.env)
        except Exception as exc:  # noqa: BLE001 - whatever the environment raises, every try raises it again
            raise ConfigError(f"run {run_id}: environment {config.env.name!r} cannot be built: "
                              f"{type(exc).__name__}: {exc}") from exc
        context = RunContext(config, env)
        self._cache[run_id] = context
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return context


def draw_task(env: Environment, split: Split, index: int) -> Task:
    """`env.task(split, index)`, with whatever the environment raises (a data file that is missing,
    too few distinct questions for `eval_size`) as a ConfigError: the same draw fails the same way
    on every try, so retrying it would only hide the reason."""
    try:
        return env.task(split, index)
    except Exception as exc:  # noqa: BLE001 - see above
        raise ConfigError(f"environment {env.name!r} cannot produce {split} task {index}: "
                          f"{type(exc).__name__}: {exc}") from exc
