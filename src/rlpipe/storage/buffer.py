"""The trajectory buffer in Postgres: groups and trajectories are written by rollouts and
claimed by train steps. Every write is keyed by its natural key, so a retried activity or a
replayed workflow changes nothing the second time.

    start_group ─▶ save_turn / save_tool_result (per turn) ─▶ finish_group ─▶ claim_batch(step)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from rlpipe.schemas.tables import PolicyVersion, RolloutGroup, Trajectory, Turn
from rlpipe.schemas.trajectory import AssembledTrajectory, TurnTokens
from rlpipe.storage.runs import record_failure


# -- groups -----------------------------------------------------------------------------------------
def start_group(s: Session, *, run_id: str, group_index: int, prompt_index: int, task_id: str, workflow_id: str,
                n_samples: int, prompt_ids: list[int]) -> list[int]:
    """Create the group and its `n_samples` trajectories (status generating); returns trajectory
    ids in sample order. Calling it again returns the same ids."""
    s.execute(insert(RolloutGroup).values(run_id=run_id, group_index=group_index, prompt_index=prompt_index,
                                          task_id=task_id, workflow_id=workflow_id, n_samples=n_samples)
              .on_conflict_do_nothing(constraint="uq_rollout_groups_run_id_group_index"))
    group_id = s.scalar(sa.select(RolloutGroup.id).where(RolloutGroup.run_id == run_id,
                                                         RolloutGroup.group_index == group_index))
    s.execute(insert(Trajectory).values([{"run_id": run_id, "group_id": group_id, "sample_index": i,
                                          "prompt_ids": prompt_ids} for i in range(n_samples)])
              .on_conflict_do_nothing(constraint="uq_trajectories_group_id_sample_index"))
    return list(s.scalars(sa.select(Trajectory.id).where(Trajectory.group_id == group_id)
                          .order_by(Trajectory.sample_index)))


@dataclass(frozen=True)
class TrajectoryContext:
    run_id: str
    trajectory_id: int
    group_index: int
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    turns: list[Turn]


def trajectory_context(s: Session, trajectory_id: int) -> TrajectoryContext:
    row = s.execute(sa.select(Trajectory, RolloutGroup.group_index, RolloutGroup.prompt_index)
                    .join(RolloutGroup, RolloutGroup.id == Trajectory.group_id)
                    .where(Trajectory.id == trajectory_id)).one_or_none()
    if row is None:
        raise LookupError(f"no trajectory {trajectory_id}")
    traj, group_index, prompt_index = row
    turns = list(s.scalars(sa.select(Turn).where(Turn.trajectory_id == trajectory_id).order_by(Turn.turn_index)))
    return TrajectoryContext(traj.run_id, traj.id, group_index, prompt_index, traj.sample_index,
                             list(traj.prompt_ids or []), turns)


# -- turns ------------------------------------------------------------------------------------------
def save_turn(s: Session, values: dict[str, Any]) -> Turn:
    """Insert a turn unless it exists; returns the stored row (the first write wins)."""
    s.execute(insert(Turn).values(**values).on_conflict_do_nothing(constraint="uq_turns_trajectory_id_turn_index"))
    return get_turn(s, values["trajectory_id"], values["turn_index"])


def get_turn(s: Session, trajectory_id: int, turn_index: int) -> Turn:
    turn = s.scalar(sa.select(Turn).where(Turn.trajectory_id == trajectory_id, Turn.turn_index == turn_index))
    if turn is None:
        raise LookupError(f"trajectory {trajectory_id} has no turn {turn_index}")
    return turn


def find_turn(s: Session, trajectory_id: int, turn_index: int) -> Turn | None:
    return s.scalar(sa.select(Turn).where(Turn.trajectory_id == trajectory_id, Turn.turn_index == turn_index))


def save_tool_result(s: Session, trajectory_id: int, turn_index: int, call_index: int,
                     result: dict[str, Any]) -> dict[str, Any]:
    """Store a tool call's result in its turn (once: a retried call keeps the first result)."""
    turn = s.scalar(sa.select(Turn).where(Turn.trajectory_id == trajectory_id, Turn.turn_index == turn_index)
                    .with_for_update())
    if turn is None:
        raise LookupError(f"trajectory {trajectory_id} has no turn {turn_index}")
    calls = [dict(c) for c in (turn.tool_calls or [])]
    if calls[call_index].get("result") is None:
        calls[call_index]["result"] = result
        turn.tool_calls = calls
        turn.tool_latency_s = sum(c["result"]["latency_s"] for c in calls if c.get("result"))
    return calls[call_index]["result"]


def turn_tokens(turn: Turn) -> TurnTokens:
    return TurnTokens(list(turn.input_ids), list(turn.output_ids), list(turn.output_logprobs),
                      turn.version_spans)


# -- finishing a group ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FinishedSample:
    trajectory_id: int
    reward: float
    advantage: float | None
    trajectory: AssembledTrajectory
    finish_reason: str | None
    n_turns: int


def finish_group(s: Session, *, run_id: str, group_index: int, samples: Sequence[FinishedSample],
                 discarded_ids: Sequence[int], status: str, reason: str | None) -> RolloutGroup:
    """Write rewards, advantages and token arrays of the kept samples and close the group, in the
    caller's transaction. A group already closed is returned unchanged (idempotent)."""
    group = s.scalar(sa.select(RolloutGroup).where(RolloutGroup.run_id == run_id,
                                                   RolloutGroup.group_index == group_index).with_for_update())
    if group is None:
        raise LookupError(f"run {run_id} has no group {group_index}")
    if group.status != "running":
        return group
    for sample in samples:
        t = sample.trajectory
        s.execute(sa.update(Trajectory).where(Trajectory.id == sample.trajectory_id).values(
            status="completed", completion_ids=t.completion_ids, loss_mask=t.loss_mask,
            sampler_logprobs=t.sampler_logprobs, policy_version=t.min_version, version_spans=t.version_spans,
            n_turns=sample.n_turns, finish_reason=sample.finish_reason, reward=sample.reward,
            advantage=sample.advantage, completed_at=sa.func.now()))
    if discarded_ids:
        s.execute(sa.update(Trajectory).where(Trajectory.id.in_(discarded_ids))
                  .values(status="failed" if status != "completed" else "discarded", status_reason=reason))
    rewards = [x.reward for x in samples]
    versions = [v for x in samples for v in [x.trajectory.min_version] if v is not None]
    spans = [span[0] for x in samples for span in x.trajectory.version_spans]
    group.status, group.status_reason = status, reason
    group.n_completed = len(samples)
    group.min_version = min(versions) if versions else None
    group.max_version = max(spans) if spans else None
    group.reward_mean = sum(rewards) / len(rewards) if rewards else None
    group.reward_std = _std(rewards) if rewards else None
    group.completed_at = sa.func.now()
    return group


UNINFORMATIVE = "uninformative"
"""The status_reason prefix of a group dropped by dynamic sampling (rollout.dynamic_sampling)."""


def uninformative_in_a_row(s: Session, run_id: str) -> int:
    """Groups of the run dropped as uninformative since its latest completed group."""
    latest_kept = (sa.select(sa.func.max(RolloutGroup.completed_at))
                   .where(RolloutGroup.run_id == run_id, RolloutGroup.status == "completed").scalar_subquery())
    return int(s.scalar(sa.select(sa.func.count()).where(
        RolloutGroup.run_id == run_id, RolloutGroup.status == "dropped",
        RolloutGroup.status_reason.startswith(UNINFORMATIVE),
        RolloutGroup.completed_at > sa.func.coalesce(latest_kept, sa.literal("-infinity").cast(sa.DateTime(True))),
    )) or 0)


def admit_uninformative(s: Session, *, run_id: str, group_index: int, rewards: Sequence[float],
                        budget: int) -> tuple[str, str | None]:
    """Dynamic sampling's verdict on a group whose rewards are all equal, as (status, reason): dropped
    (the launcher draws another), or kept with its zero advantages once `budget` groups in a row were
    dropped, so that a saturated task cannot stall the run (a failures row says so)."""
    why = f"{UNINFORMATIVE}: all {len(rewards)} rewards are {rewards[0]:g}"
    in_a_row = uninformative_in_a_row(s, run_id)
    if in_a_row < budget:
        return "dropped", why
    record_failure(s, run_id=run_id, kind="dynamic_sampling", error_type="DynamicSamplingBudget",
                   message=f"group {group_index} kept with zero advantages ({why}): {in_a_row} uninformative "
                           f"groups in a row reached rollout.dynamic_sampling_budget={budget}",
                   workflow_id=f"{run_id}-group-{group_index}", activity_id="dynamic-sampling")
    return "completed", None


def _std(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5


# -- claiming a batch -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Claim:
    consumed: list[int]
    """Group indices this step trains on (oldest first)."""
    dropped: list[int]
    """Completed groups too stale to train on, marked dropped."""


class NotEnoughFreshGroups(RuntimeError):
    """Fewer fresh completed groups than a step needs; the step is retried when more arrive."""


def claim_batch(s: Session, *, run_id: str, step: int, groups_per_step: int, min_trained_steps: int) -> Claim:
    """Claim `groups_per_step` fresh completed groups for `step` (FIFO), dropping stale ones.

    Fresh: generated by weights with at least `min_trained_steps` optimiser steps (the freshness
    rule). A step claims once: a retry returns the groups it already claimed, so a group can
    never be consumed by two steps, and a step's batch never changes.
    """
    already = list(s.scalars(sa.select(RolloutGroup.group_index).where(
        RolloutGroup.run_id == run_id, RolloutGroup.claimed_step == step).order_by(RolloutGroup.group_index)))
    if already:
        return Claim(consumed=already, dropped=[])
    generated_at = (sa.select(PolicyVersion.trained_steps)
                    .where(PolicyVersion.run_id == run_id, PolicyVersion.version == RolloutGroup.min_version)
                    .scalar_subquery())
    unclaimed = sa.and_(RolloutGroup.run_id == run_id, RolloutGroup.status == "completed",
                        RolloutGroup.claimed_step.is_(None))
    dropped = list(s.scalars(sa.update(RolloutGroup).where(unclaimed, generated_at < min_trained_steps)
                             .values(status="dropped", status_reason=f"stale for step {step}: generated before "
                                     f"trained step {min_trained_steps}", consumed_at=sa.func.now())
                             .returning(RolloutGroup.group_index)))
    fresh = list(s.scalars(sa.select(RolloutGroup.id).where(unclaimed, generated_at >= min_trained_steps)
                           .order_by(RolloutGroup.completed_at, RolloutGroup.group_index)
                           .limit(groups_per_step).with_for_update(skip_locked=True)))
    if len(fresh) < groups_per_step:
        raise NotEnoughFreshGroups(f"step {step} of run {run_id} needs {groups_per_step} fresh groups, "
                                   f"found {len(fresh)}")
    consumed = list(s.scalars(sa.update(RolloutGroup).where(RolloutGroup.id.in_(fresh))
                              .values(claimed_step=step).returning(RolloutGroup.group_index)))
    return Claim(consumed=sorted(consumed), dropped=sorted(dropped))


def claimed_trajectories(s: Session, run_id: str, step: int) -> list[Trajectory]:
    """The completed trajectories of the groups `step` claimed, in (group, sample) order: the
    step's batch, also when it is replayed to recover the trainer's state."""
    return list(s.scalars(sa.select(Trajectory).join(RolloutGroup, RolloutGroup.id == Trajectory.group_id)
                          .where(RolloutGroup.run_id == run_id, RolloutGroup.claimed_step == step,
                                 Trajectory.status == "completed")
                          .order_by(RolloutGroup.group_index, Trajectory.sample_index)))
