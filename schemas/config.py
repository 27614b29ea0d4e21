"""`RunConfig`: everything a training run needs, validated before the run starts.

A run is started with one RunConfig (TOML through the CLI, or JSON pasted into the Temporal Web
UI's Start Workflow form). Unknown keys and bad values are rejected with a message that names the
field. No ML imports here: the CLI and the workflow worker validate configs without torch.
Secrets (database password, S3 keys) never belong in a RunConfig: workers read them from their
environment, so they never reach Temporal history.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlpipe.registry import names_used, registered_names, unusable
from rlpipe.sandbox.latency import LatencyModel, NoLatency
from rlpipe.schemas.algorithm import AdvantageConfig, BatchConfig, LossConfig, OptimConfig
from rlpipe.schemas.task import EnvConfig, GraderConfig
from rlpipe.schemas.tracking import TrackerName, TrackersConfig, check_tracking

RUN_NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelConfig(Strict):
    path: str = ".rlpipe/models/tiny"
    """Directory of the policy's weights (safetensors + config + tokenizer), as prepared by
    `rlpipe model prepare`. The trainer and the vLLM servers both load it; relative paths are
    resolved against the worker's working directory."""
    max_model_len: int = Field(512, ge=64)
    """Longest prompt + completion, in tokens; a trajectory that would exceed it stops early."""


class SamplingConfig(Strict):
    """How the inference servers sample. The trainer evaluates logprobs at the same temperature."""

    max_tokens: int = Field(64, ge=1)
    """Tokens one model turn may generate."""
    temperature: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Sampling temperature; 1.0 keeps the sampler's and the trainer's distributions comparable."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; 1.0 samples from the whole distribution (what the policy gradient assumes)."""
    seed: int = 0
    """Base of the per-request seeds: sample i of group g uses a seed derived from (seed, g, i)."""


class RolloutConfig(Strict):
    """How many rollouts run and how the long tail is governed."""

    group_size: int = Field(4, ge=1)
    """G: samples per prompt. Advantages compare the samples of a group, so G >= 2 in practice."""
    groups_per_step: int = Field(4, ge=1)
    """Prompt groups in one optimiser step's global batch."""
    max_concurrent_groups: int = Field(8, ge=1)
    """Groups in flight at once, whatever the staleness budget allows (caps server load)."""
    generate_timeout_s: float = Field(120.0, gt=0)
    """Limit of one model call (start-to-close); a timed-out call is retried."""
    generate_attempts: int = Field(5, ge=1)
    """Tries of one model call before its sample fails."""
    tool_timeout_s: float = Field(30.0, gt=0)
    """Limit of one tool call, injected latency included."""
    tool_attempts: int = Field(3, ge=1)
    grade_timeout_s: float = Field(120.0, gt=0)
    """Limit of grading one group."""
    grade_attempts: int = Field(3, ge=1)
    outage_budget_s: float = Field(900.0, gt=0)
    """How long a model call, tool call or grading waits out an unreachable database, object store
    or inference server (retrying with backoff up to 30 s apart) before its sample or group fails.
    Apart from `*_attempts`, which count only the task's own errors."""
    group_deadline_s: float | None = Field(None, gt=0)
    """Wall-clock limit of a whole group; None waits for every sample."""
    straggler_policy: Literal["drop", "partial"] = "drop"
    """At the deadline: drop the group (recorded as failed), or keep the finished samples as a partial
    group if at least `min_partial_samples` finished (advantages use only those)."""
    min_partial_samples: int = Field(2, ge=1)
    """Fewest finished samples a partial group may have."""
    pause_after_failed_groups: int | None = Field(32, ge=1)
    """Pause the run when this many groups in a row failed, none completing in between: a grader,
    tool or environment that fails every time would otherwise spend compute forever. The pause
    reason quotes the last failure; `resume` starts the count again. None never pauses. (Groups
    dropped at their deadline are the straggler policy at work, not failures, and do not count.)"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal (every sample right, or every one
    wrong) has advantage 0 everywhere and teaches nothing, so it is dropped when it completes
    (status 'dropped', reason 'uninformative: ...'; its trajectories and rewards stay for audit) and
    the launcher draws another in its place, within the staleness budget."""
    dynamic_sampling_budget: int = Field(16, ge=1)
    """Uninformative groups that may be dropped in a row. The next one is kept, with its zero
    advantages, and a `failures` row says so: a policy that has saturated its task (or a grader
    that scores everything alike) slows the run down instead of stalling it."""
    hedge_samples: int = Field(0, ge=0)
    """Extra samples started per group; the first `group_size` to finish are kept, the rest discarded."""
    max_group_history_events: int = Field(8000, ge=50)
    """A group's workflow continues-as-new (keeping every finished turn) once its history holds this
    many events, or sooner if Temporal suggests it. Temporal fails a workflow at 51,200 events and
    warns from 10,240; the history may still grow by the turn each sample has in flight (about 6
    events per model or tool call), so leave room below those for G samples' widest turn."""
    tool_latency: LatencyModel = NoLatency()
    """Latency injected before every tool call, to emulate remote sandboxes and their long tail:
    {kind = "none"}, {kind = "constant", seconds}, {kind = "lognormal", median_seconds, sigma, seed}
    or {kind = "trace", seconds = [...]} (replayed cyclically)."""


class SyncConfig(Strict):
    """Weight sync: how often the trainer publishes and how servers load it."""

    interval: int = Field(1, ge=1)
    """Publish and sync every this many optimiser steps (cost of syncing vs staleness of data)."""
    pause_mode: Literal["abort", "wait", "keep"] = "wait"
    """abort: in-flight requests are aborted and retried on the new weights; wait: drain them first;
    keep: they continue on the new weights and record both versions (as spans)."""
    verify: bool = True
    """Compare the server's logprobs on a fixed probe with the trainer's before marking a version live."""
    verify_tolerance: float | None = Field(None, gt=0)
    """Largest allowed |server - trainer| logprob difference on the probe tokens. None: derived from
    the dtype each server computes in (weights/tolerance.py): 2e-4 for fp32 servers (a faithful load
    differs by ~1e-5 from the trainer's probe, the fp32 forward of the published bytes), 1.0 for
    bf16 and fp16 servers (bf16's own rounding moves it by up to ~0.4: only gross errors are
    caught). A server in any other dtype refuses the load until this is set."""
    weights_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype of the published inference weights. bfloat16 halves what every sync moves; the
    trainer's fp32 master weights then travel in the optimizer's recovery state, so a restore
    stays exact."""
    transport: Literal["file", "stream"] = "file"
    """How a server gets a version. file: its sidecar reads the checkpoint (the trainer's files when
    shared, else a download from S3) and vLLM reloads it from disk. stream: the server's vLLM
    weight-transfer engine pulls it from the trainer's memory-mapped file over TCP while it still
    serves, in buckets in the server's dtype, each checked by crc32 (weights/stream.py), and the
    pause only loads it: no file is downloaded, and the trainer uploads to S3 (the durable record)
    beside its next step instead of before it publishes. A version the trainer no longer serves (a
    restarted trainer, a deleted file) is loaded as by file."""
    timeout_s: float = Field(600.0, gt=0)
    recovery_state_every: int = Field(8, ge=1)
    """Store the recovery state (for trainer recovery only) with a published version when at least this
    many steps have passed since the last stored one, and after the run's last step. A restarted trainer
    restores the newest stored state and replays the recorded steps since, so it replays fewer than
    `recovery_state_every + interval` steps; 1 stores it with every version. The state is the fp32
    weights and AdamW's two moments, three times the weights' size, written a file per rank: the
    largest write of a publish."""


class RetentionConfig(Strict):
    """Which published versions keep their bytes (weights in the object store and on local disks,
    optimizer states). Unset: every version is kept. Whatever the policy, a version still needed is
    kept: the newest, each one an inference server holds, and the one a restarted trainer would
    restore from. A deleted version keeps its `policy_versions` row (hash, lineage) with `deleted_at`."""

    keep_last: int | None = Field(None, ge=1)
    """Keep the newest this many versions."""
    keep_every: int | None = Field(None, ge=1)
    """Also keep every version whose number is a multiple of this (version 0, the base, included)."""

    @model_validator(mode="after")
    def _every_needs_last(self) -> RetentionConfig:
        if self.keep_every is not None and self.keep_last is None:
            raise ValueError("keep_every needs keep_last: without keep_last every version is kept")
        return self


class EvalConfig(Strict):
    """Held-out evaluation of published versions (greedy, through an inference server)."""

    prompts: int = Field(100, ge=0)
    """Eval prompts per evaluation (the first ones of the environment's eval split); 0 disables."""
    every_versions: int | None = Field(None, ge=1)
    """Also evaluate every this many published versions; the base and the final version always are."""
    max_tokens: int = Field(64, ge=1)
    """Tokens per model turn during evaluation."""


class RunConfig(Strict):
    """One training run. Defaults give a short run of the tiny test model on arithmetic."""

    name: str = Field("run", pattern=RUN_NAME_PATTERN)
    """Run name: lowercase letters, digits, '.', '_' or '-'. The workflow id is `run-<name>`."""
    mode: Literal["async", "sync"] = "async"
    """async: rollouts never wait for the trainer, within the staleness budget; sync: the lock-step
    baseline (generate a batch, train, sync, repeat) — the same code with max_staleness 0."""
    steps: int = Field(4, ge=1)
    """Optimiser steps to run."""
    max_staleness: int | None = Field(None, ge=0)
    """Optimiser steps a trajectory's weights may lag the step that trains on it. Default 1 in async
    mode, 0 (and only 0) in sync mode."""
    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig()
    grader: GraderConfig = GraderConfig()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    batch: BatchConfig = BatchConfig()
    sync: SyncConfig = SyncConfig()
    retention: RetentionConfig = RetentionConfig()
    eval: EvalConfig = EvalConfig()
    continue_as_new_every: int | None = Field(None, ge=1)
    """Continue-as-new after this many steps in one workflow run (besides when Temporal suggests
    it); keeps histories short in very long runs and lets tests exercise the hand-over."""
    tracking: list[TrackerName] = []
    """Experiment trackers that receive the run's metrics from Postgres: "tensorboard", "mlflow", "wandb".
    Off the trainer's path: a tracker that is down never slows or fails the run
    (docs/tracking.md)."""
    trackers: TrackersConfig = TrackersConfig()
    """Settings of each tracker (log directory, tracking URI, project...)."""

    @field_validator("tracking")
    @classmethod
    def _trackers_once(cls, names: list[TrackerName]) -> list[TrackerName]:
        return check_tracking(names)

    @model_validator(mode="after")
    def _schedule_is_consistent(self) -> RunConfig:
        if self.mode == "sync":
            if self.max_staleness not in (None, 0):
                raise ValueError(f"max_staleness is {self.max_staleness} but mode 'sync' trains only on fresh "
                                 "data: remove max_staleness or set mode = 'async'")
            if self.sync.interval != 1:
                raise ValueError(f"sync.interval is {self.sync.interval} but mode 'sync' syncs after every "
                                 "step: set sync.interval = 1 or mode = 'async'")
        if self.sync.interval > self.staleness + 1:
            raise ValueError(f"sync.interval ({self.sync.interval}) > max_staleness + 1 ({self.staleness + 1}): "
                             "rollouts would run out of fresh weights and the trainer would starve. "
                             "Raise max_staleness or lower sync.interval")
        if self.rollout.groups_per_step % self.batch.world_size:
            raise ValueError(f"rollout.groups_per_step ({self.rollout.groups_per_step}) must be a multiple of "
                             f"batch.world_size ({self.batch.world_size}): every rank gets whole groups")
        if self.rollout.straggler_policy == "partial" and self.rollout.min_partial_samples > self.rollout.group_size:
            raise ValueError(f"rollout.min_partial_samples ({self.rollout.min_partial_samples}) exceeds "
                             f"rollout.group_size ({self.rollout.group_size})")
        if self.loss.temperature != self.sampling.temperature:
            raise ValueError(f"loss.temperature ({self.loss.temperature}) differs from sampling.temperature "
                             f"({self.sampling.temperature}): the trainer must score tokens at the temperature "
                             "they were sampled at; set both to the same value")
        return self

    @model_validator(mode="after")
    def _rubric_graders_registered(self) -> RunConfig:
        """With no grader.name the environment's rubric grades: a grader it names that nobody registered
        must stop the run here, not fail every group later in the grader worker."""
        rubric = names_used("environment", self.env.name, "grader")
        known = registered_names("grader")
        if self.grader.name is not None or rubric is None or known is None:
            return self
        missing = [name for name in rubric if name not in known and unusable("grader", name) is not None]
        if missing:
            raise ValueError(f"env {self.env.name!r} grades with its rubric ({', '.join(rubric)}), but grader(s) "
                             f"{', '.join(missing)} are not registered (known graders: {', '.join(known)}): register "
                             "them with rlpipe.graders.registry.register_grader, fix the environment's rubric, "
                             "or set grader.name")
        return self

    @property
    def staleness(self) -> int:
        """max_staleness with its mode default applied."""
        if self.max_staleness is not None:
            return self.max_staleness
        return 0 if self.mode == "sync" else 1

    @property
    def workflow_id(self) -> str:
        return f"run-{self.name}"


class ConfigError(ValueError):
    """A run config that cannot be used; the message names the field and what is wrong."""


def describe_validation_error(exc: ValidationError, source: str = "config") -> str:
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see docs/configuration.md)"
        lines.append(f"{source}: {field}: {message}")
    return "\n".join(lines)


def parse_run_config(data: dict[str, Any], source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, source)) from exc


def load_run_config(path: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read a TOML run config; `overrides` (e.g. {"name": ...}) replace top-level keys."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse_run_config({**data, **(overrides or {})}, source=str(path))
