"""The Postgres schema: the buffer of trajectories and the audit trail of a run.

Every table has its natural key as a named unique constraint, so every write can be an
idempotent upsert: a retried or replayed activity can never duplicate or skip data.

    runs ─┬─ policy_versions (run, version)          published checkpoints, contiguous
          ├─ rollout_groups (run, group_index) ─── trajectories (group, sample_index) ─┬─ turns (trajectory, turn_index)
          │                                                                          └─ grades (trajectory, grader)
          ├─ train_steps (run, step)                 one row per committed optimiser step
          ├─ sync_events (run, version, server)      weight loads into inference servers
          └─ failures                                every retried or terminal error
    grader_cache (key)                                grades by hash of (grader, version, prompt, response)
    inference_servers (name)                          the fleet: where each named server is reached
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    Text,
    TypeDecorator,
    UniqueConstraint,
    func,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, REAL
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


NUL_REPLACEMENT = "\ufffd"
"""What a NUL character is stored as: PostgreSQL's text and jsonb refuse NUL, and a model (a
byte-fallback token) or a tool's output can produce one."""


def text_without_nul(text: str) -> str:
    return text.replace("\x00", NUL_REPLACEMENT)


def without_nul(value: Any) -> Any:
    """`value` with NUL replaced in every string, also inside JSON lists and objects (keys too)."""
    if isinstance(value, str):
        return text_without_nul(value)
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_nul(v) for v in value]
    return value


class StoredText(TypeDecorator[str]):
    """A text column that accepts any Python string (NUL is replaced, see NUL_REPLACEMENT)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        return None if value is None else text_without_nul(value)


class StoredJSON(TypeDecorator[Any]):
    """A jsonb column that accepts any JSON value built from model or tool text."""

    impl = JSONB
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return without_nul(value)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: StoredJSON, list[Any]: StoredJSON, str: StoredText,
                           datetime: DateTime(timezone=True)}


id_pk = Annotated[int, mapped_column(BigInteger, Identity(), primary_key=True)]
timestamp_now = Annotated[datetime, mapped_column(server_default=func.now())]
run_fk = Annotated[str, mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)]
int_ids = Annotated[list[int], mapped_column(ARRAY(Integer))]
float_values = Annotated[list[float], mapped_column(ARRAY(REAL))]

RUN_STATUSES = ("running", "paused", "completed", "failed", "cancelled")
GROUP_STATUSES = ("running", "completed", "dropped", "failed")
TRAJECTORY_STATUSES = ("generating", "completed", "failed", "discarded")
SYNC_STATUSES = ("ok", "failed", "rolled_back", "refused", "superseded")
"""superseded: a retried load found the server already on a newer verified version (storage/syncs.py)."""


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} in ({', '.join(repr(v) for v in values)})"


def _finite(column: str) -> str:
    """Postgres floats admit NaN and ±Infinity; a metric or score that is either is a bug."""
    return f"{column} is null or ({column} <> 'NaN'::float8 and abs({column}) < 'Infinity'::float8)"


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(_one_of("mode", ("async", "sync")), name="mode"),
        CheckConstraint(_one_of("status", RUN_STATUSES), name="status"),
        CheckConstraint("id ~ '^[a-z0-9][a-z0-9_.-]{0,62}$'", name="id_slug"),
    )

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    """The run name; the TrainingRun workflow id is derived from it."""
    workflow_id: Mapped[str] = mapped_column(Text, unique=True)
    mode: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text, server_default="running")
    status_reason: Mapped[str | None]
    config: Mapped[dict[str, Any]]
    config_sha256: Mapped[str] = mapped_column(Text)
    """A second start of the same run name must carry the same config (idempotent start)."""
    created_at: Mapped[timestamp_now]
    updated_at: Mapped[timestamp_now]
    finished_at: Mapped[datetime | None]


class PolicyVersion(Base):
    """A published checkpoint. Append-only; versions are contiguous per run (a trigger in the
    migration enforces version = previous + 1 and strictly increasing trained_steps)."""

    __tablename__ = "policy_versions"
    __table_args__ = (
        UniqueConstraint("run_id", "version"),
        UniqueConstraint("run_id", "trained_steps"),
        CheckConstraint("version >= 0", name="version_non_negative"),
        CheckConstraint("trained_steps >= 0", name="trained_steps_non_negative"),
        CheckConstraint("size_bytes >= 0", name="size_non_negative"),
        CheckConstraint("sha256 ~ '^[0-9a-f]{64}$'", name="sha256_hex"),
    )

    id: Mapped[id_pk]
    run_id: Mapped[run_fk]
    version: Mapped[int]
    trained_steps: Mapped[int]
    """Optimiser steps folded into these weights; staleness is measured in steps."""
    checkpoint_key: Mapped[str] = mapped_column(Text)
    """Object-store key of the checkpoint's manifest."""
    sha256: Mapped[str] = mapped_column(Text)
    """sha256 of the weights file (safetensors)."""
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    probe: Mapped[dict[str, Any] | None]
    """Probe token ids and the trainer's reference logprobs, to verify a sync."""
    created_at: Mapped[timestamp_now]
    deleted_at: Mapped[datetime | None]
    """When the run's retention policy deleted the version's bytes (the row, with its hash, stays)."""
    stream_endpoint: Mapped[str | None] = mapped_column(Text)
    """The trainer's weight stream ("host:port") that served the version when it was published
    (weights/stream.py); null when none did."""


class RolloutGroup(Base):
    """One prompt × G samples. `claimed_step` is set once, by the train step that consumes it."""

    __tablename__ = "rollout_groups"
    __table_args__ = (
        UniqueConstraint("run_id", "group_index"),
        CheckConstraint(_one_of("status", GROUP_STATUSES), name="status"),
        CheckConstraint("group_index >= 0", name="group_index_non_negative"),
        CheckConstraint("n_samples >= 1", name="n_samples_positive"),
        CheckConstraint("n_completed >= 0 and n_completed <= n_samples", name="n_completed_range"),
        CheckConstraint("claimed_step is null or (status = 'completed' and claimed_step >= 1)", name="claim_valid"),
        CheckConstraint("min_version is null or min_version >= 0", name="min_version_non_negative"),
        CheckConstraint(_finite("reward_mean"), name="reward_mean_finite"),
        Index("ix_rollout_groups_claim", "run_id", "status", "claimed_step", "min_version"),
    )

    id: Mapped[id_pk]
    run_id: Mapped[run_fk]
    group_index: Mapped[int]
    prompt_index: Mapped[int]
    task_id: Mapped[str] = mapped_column(Text)
    workflow_id: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text, server_default="running")
    status_reason: Mapped[str | None]
    n_samples: Mapped[int]
    n_completed: Mapped[int] = mapped_column(server_default="0")
    min_version: Mapped[int | None]
    """Oldest policy version that produced any token of the group (freshness is judged on it)."""
    max_version: Mapped[int | None]
    reward_mean: Mapped[float | None] = mapped_column(Float)
    reward_std: Mapped[float | None] = mapped_column(Float)
    claimed_step: Mapped[int | None]
    started_at: Mapped[timestamp_now]
    completed_at: Mapped[datetime | None]
    consumed_at: Mapped[datetime | None]


class Trajectory(Base):
    """One sample: token ids in and out, the loss mask (1 = model token, 0 = tool/env token) and
    the sampler's per-token logprobs, all aligned with `completion_ids`."""

    __tablename__ = "trajectories"
    __table_args__ = (
        UniqueConstraint("group_id", "sample_index"),
        CheckConstraint(_one_of("status", TRAJECTORY_STATUSES), name="status"),
        CheckConstraint("sample_index >= 0", name="sample_index_non_negative"),
        CheckConstraint("n_turns >= 0", name="n_turns_non_negative"),
        CheckConstraint(
            "status <> 'completed' or (cardinality(completion_ids) = cardinality(loss_mask) "
            "and cardinality(completion_ids) = cardinality(sampler_logprobs))",
            name="aligned_arrays",
        ),
        CheckConstraint(_finite("reward"), name="reward_finite"),
        CheckConstraint(_finite("advantage"), name="advantage_finite"),
        Index("ix_trajectories_run_status", "run_id", "status"),
    )

    id: Mapped[id_pk]
    run_id: Mapped[run_fk]
    group_id: Mapped[int] = mapped_column(ForeignKey("rollout_groups.id", ondelete="CASCADE"), index=True)
    sample_index: Mapped[int]
    status: Mapped[str] = mapped_column(Text, server_default="generating")
    status_reason: Mapped[str | None]
    prompt_ids: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    completion_ids: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    loss_mask: Mapped[list[int] | None] = mapped_column(ARRAY(SmallInteger))
    sampler_logprobs: Mapped[list[float] | None] = mapped_column(ARRAY(REAL))
    policy_version: Mapped[int | None]
    """The oldest version that generated any of its tokens (see version_spans for all)."""
    version_spans: Mapped[list[Any] | None]
    """[[version, first_token, end_token), ...] over completion_ids."""
    n_turns: Mapped[int] = mapped_column(server_default="0")
    finish_reason: Mapped[str | None]
    reward: Mapped[float | None] = mapped_column(Float)
    advantage: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[timestamp_now]
    completed_at: Mapped[datetime | None]


class Turn(Base):
    """One model call of a trajectory and the tool calls it led to."""

    __tablename__ = "turns"
    __table_args__ = (
        UniqueConstraint("trajectory_id", "turn_index"),
        CheckConstraint("turn_index >= 0", name="turn_index_non_negative"),
        CheckConstraint("cardinality(output_ids) = cardinality(output_logprobs)", name="aligned_arrays"),
        CheckConstraint("generate_latency_s >= 0", name="latency_non_negative"),
    )

    id: Mapped[id_pk]
    trajectory_id: Mapped[int] = mapped_column(ForeignKey("trajectories.id", ondelete="CASCADE"), index=True)
    turn_index: Mapped[int]
    input_ids: Mapped[int_ids]
    """Tokens appended before this call: the prompt for turn 0, tool/env output ids after."""
    output_ids: Mapped[int_ids]
    output_logprobs: Mapped[float_values]
    output_text: Mapped[str]
    finish_reason: Mapped[str | None]
    server: Mapped[str | None]
    version_before: Mapped[int | None]
    version_after: Mapped[int | None]
    version_spans: Mapped[list[Any] | None]
    """[[version, first, end), ...] over output_ids; two spans when a sync happened mid-request."""
    generate_latency_s: Mapped[float] = mapped_column(Float)
    tool_calls: Mapped[list[Any] | None]
    """What the environment parsed from the output: tool calls with their results and latency."""
    tool_latency_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[timestamp_now]


class Grade(Base):
    __tablename__ = "grades"
    __table_args__ = (
        UniqueConstraint("trajectory_id", "grader"),
        CheckConstraint(_finite("score") + " and score is not null", name="score_finite"),
        CheckConstraint("latency_s >= 0", name="latency_non_negative"),
    )

    id: Mapped[id_pk]
    trajectory_id: Mapped[int] = mapped_column(ForeignKey("trajectories.id", ondelete="CASCADE"), index=True)
    grader: Mapped[str] = mapped_column(Text)
    grader_version: Mapped[str] = mapped_column(Text)
    score: Mapped[float] = mapped_column(Float)
    details: Mapped[dict[str, Any] | None]
    latency_s: Mapped[float] = mapped_column(Float)
    cache_hit: Mapped[bool]
    created_at: Mapped[timestamp_now]


class GraderCacheEntry(Base):
    __tablename__ = "grader_cache"
    __table_args__ = (
        CheckConstraint("key ~ '^[0-9a-f]{64}$'", name="key_sha256"),
        CheckConstraint(_finite("score") + " and score is not null", name="score_finite"),
        CheckConstraint("hits >= 0", name="hits_non_negative"),
    )

    key: Mapped[str] = mapped_column(Text, primary_key=True)
    """sha256 of (grader, grader version, prompt, response)."""
    grader: Mapped[str] = mapped_column(Text)
    grader_version: Mapped[str] = mapped_column(Text)
    score: Mapped[float] = mapped_column(Float)
    details: Mapped[dict[str, Any] | None]
    hits: Mapped[int] = mapped_column(server_default="0")
    created_at: Mapped[timestamp_now]


class TrainStep(Base):
    """A committed optimiser step. Its row is written in the same transaction that marks the
    consumed groups, so a step is committed exactly once with exactly its batch."""

    __tablename__ = "train_steps"
    __table_args__ = (
        UniqueConstraint("run_id", "step"),
        CheckConstraint("step >= 1", name="step_positive"),
        CheckConstraint("n_groups >= 0 and n_trajectories >= 0 and n_tokens >= 0", name="counts_non_negative"),
        CheckConstraint("staleness_max is null or staleness_max >= 0", name="staleness_non_negative"),
        CheckConstraint("max_staleness is null or max_staleness >= 0", name="max_staleness_non_negative"),
        CheckConstraint(_finite("loss"), name="loss_finite"),
        CheckConstraint("finished_at >= started_at", name="time_order"),
    )

    id: Mapped[id_pk]
    run_id: Mapped[run_fk]
    step: Mapped[int]
    policy_version: Mapped[int]
    """Latest published version when the step started (the one rollouts were catching up to)."""
    published_version: Mapped[int | None]
    """Version this step published, if it was a sync step."""
    n_groups: Mapped[int]
    n_trajectories: Mapped[int]
    n_tokens: Mapped[int]
    loss: Mapped[float | None] = mapped_column(Float)
    reward_mean: Mapped[float | None] = mapped_column(Float)
    reward_std: Mapped[float | None] = mapped_column(Float)
    response_length_mean: Mapped[float | None] = mapped_column(Float)
    entropy: Mapped[float | None] = mapped_column(Float)
    kl_sampler: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    staleness_mean: Mapped[float | None] = mapped_column(Float)
    staleness_max: Mapped[int | None]
    max_staleness: Mapped[int | None]
    """The freshness bound this step claimed its batch under ((step - 1) - min_trained_steps): the
    run's max_staleness at the time, which `rlpipe run schedule --max-staleness` can change mid-run.
    Null for steps committed before it was recorded (migration 0004): their bound is the configured one."""
    metrics: Mapped[dict[str, Any] | None]
    """Every other per-step metric (clip fraction, importance weights, advantages, timings...)."""
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime]


class SyncEvent(Base):
    """Loading one published version into one inference server, with its timings."""

    __tablename__ = "sync_events"
    __table_args__ = (
        UniqueConstraint("run_id", "version", "server"),
        CheckConstraint(_one_of("status", SYNC_STATUSES), name="status"),
        CheckConstraint("bytes >= 0", name="bytes_non_negative"),
        CheckConstraint("attempts >= 1", name="attempts_positive"),
    )

    id: Mapped[id_pk]
    run_id: Mapped[run_fk]
    version: Mapped[int]
    server: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)
    attempts: Mapped[int] = mapped_column(server_default="1")
    download_s: Mapped[float | None] = mapped_column(Float)
    pause_s: Mapped[float | None] = mapped_column(Float)
    reload_s: Mapped[float | None] = mapped_column(Float)
    verify_s: Mapped[float | None] = mapped_column(Float)
    total_s: Mapped[float | None] = mapped_column(Float)
    transport: Mapped[str | None] = mapped_column(Text)
    """How the weights reached the server: "file" (read or downloaded, then reloaded) or "stream"
    (pulled from the trainer by the server's weight-transfer engine); null when it never started."""
    probe_max_abs_diff: Mapped[float | None] = mapped_column(Float)
    """Largest |server - trainer| logprob on the probe tokens after loading."""
    probe_tolerance: Mapped[float | None] = mapped_column(Float)
    """The largest difference the verification allowed (weights/tolerance.py); null when not verified."""
    greedy_match: Mapped[bool | None]
    """Whether the server's greedy continuation of the probe equals the trainer's up to its first
    near-tie (weights/sync.py); null when not verified or when the first token is one."""
    error: Mapped[str | None]
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime]


class Failure(Base):
    """Every error an activity met, retried or final. Recording is idempotent per attempt."""

    __tablename__ = "failures"
    __table_args__ = (
        UniqueConstraint("workflow_id", "activity_id", "attempt"),
        CheckConstraint("attempt >= 1", name="attempt_positive"),
        Index("ix_failures_run_kind", "run_id", "kind"),
    )

    id: Mapped[id_pk]
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(Text)
    """Which box failed: generate, tool, grade, persist, train, sync, config, straggler, ..."""
    activity: Mapped[str | None]
    workflow_id: Mapped[str | None]
    activity_id: Mapped[str | None]
    attempt: Mapped[int] = mapped_column(server_default="1")
    error_type: Mapped[str] = mapped_column(Text)
    message: Mapped[str]
    details: Mapped[dict[str, Any] | None]
    created_at: Mapped[timestamp_now]


class ActivitySpan(Base):
    """When each activity ran, on which box and worker: the busy/idle timeline of the pipeline."""

    __tablename__ = "activity_spans"
    __table_args__ = (
        UniqueConstraint("workflow_id", "activity_id", "attempt"),
        CheckConstraint("finished_at >= started_at", name="time_order"),
        CheckConstraint("attempt >= 1", name="attempt_positive"),
        Index("ix_activity_spans_run_box", "run_id", "box", "started_at"),
    )

    id: Mapped[id_pk]
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    box: Mapped[str] = mapped_column(Text)
    """rollout, sandbox, grader, trainer, sync or persist."""
    activity: Mapped[str] = mapped_column(Text)
    workflow_id: Mapped[str] = mapped_column(Text)
    activity_id: Mapped[str] = mapped_column(Text)
    attempt: Mapped[int]
    worker: Mapped[str] = mapped_column(Text)
    """host:pid of the worker process that ran it."""
    ok: Mapped[bool]
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime]


class EvalResult(Base):
    """Held-out accuracy of one published version (greedy decoding through an inference server)."""

    __tablename__ = "eval_results"
    __table_args__ = (
        UniqueConstraint("run_id", "version", "split"),
        CheckConstraint("n_prompts >= 1 and n_correct >= 0 and n_correct <= n_prompts", name="counts_valid"),
        CheckConstraint("accuracy >= 0 and accuracy <= 1", name="accuracy_range"),
    )

    id: Mapped[id_pk]
    run_id: Mapped[run_fk]
    version: Mapped[int]
    split: Mapped[str] = mapped_column(Text)
    n_prompts: Mapped[int]
    n_correct: Mapped[int]
    accuracy: Mapped[float] = mapped_column(Float)
    mean_reward: Mapped[float | None] = mapped_column(Float)
    details: Mapped[dict[str, Any] | None]
    created_at: Mapped[timestamp_now]


class TrackerCursor(Base):
    """How far one experiment tracker has received one run's committed record (src/rlpipe/tracking/).

    A batch is announced in `pending` (committed) before it is written to the tracker and folded into
    the cursor after; a sink that died in between finds it pending and writes it again the way that
    tracker makes a repeated write harmless, so every step reaches the tracker exactly once."""

    __tablename__ = "tracker_cursors"
    __table_args__ = (
        UniqueConstraint("run_id", "tracker"),
        CheckConstraint("step >= 0", name="step_non_negative"),
        CheckConstraint("batches >= 0", name="batches_non_negative"),
    )

    id: Mapped[id_pk]
    run_id: Mapped[run_fk]
    tracker: Mapped[str] = mapped_column(Text)
    step: Mapped[int] = mapped_column(server_default="0")
    """Train steps 1..step are logged (steps commit in order, so one number says it)."""
    logged: Mapped[list[Any]] = mapped_column(server_default="[]")
    """Keys of the other records logged: 'config', 'eval:<version>:<split>', 'sync:<version>:<server>'."""
    batches: Mapped[int] = mapped_column(server_default="0")
    """Batches written so far; the next batch's number (TensorBoard names its event file by it)."""
    pending: Mapped[dict[str, Any] | None]
    """The batch being written: {"number", "first_step", "last_step", "keys"}; null when none is."""
    error: Mapped[str | None]
    """The tracker's last error, cleared by the next batch it accepts."""
    failing_since: Mapped[datetime | None]
    updated_at: Mapped[timestamp_now]


class InferenceServer(Base):
    """A named inference server and where it is reached (storage/servers.py). Its sync sidecar
    writes the row when it starts, so a server that joins a running run is found by name by the
    workers that were started before it (rollout, grader), without a restart."""

    __tablename__ = "inference_servers"
    __table_args__ = (CheckConstraint("name <> ''", name="name_not_empty"),
                      CheckConstraint("url like 'http://%' or url like 'https://%'", name="url_is_http"))

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    url: Mapped[str] = mapped_column(Text)
    registered_at: Mapped[timestamp_now]
    """The first time a sidecar registered this name."""
    seen_at: Mapped[timestamp_now]
    """The latest time a sidecar (re)registered it: when that server's sidecar last started."""
