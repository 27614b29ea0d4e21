"""Grading a finished group: each kept trajectory's final message (or its whole conversation, for a grader
that reads it) through the run's rubric, with the Postgres cache in front of every grader, and one `grades`
row per (trajectory, grader)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from rlpipe.envs.base import Rubric, Task
from rlpipe.graders.base import Grader
from rlpipe.graders.cache import grade_with_cache
from rlpipe.graders.conversation import conversation_text, stored_turn_messages
from rlpipe.observe.metrics import METRICS
from rlpipe.schemas.tables import Grade, Trajectory, Turn
from rlpipe.storage.db import Database
from rlpipe.storage.grader_cache import PostgresGradeCache


@dataclass(frozen=True)
class GroupGrades:
    rewards: list[float]
    cache_hits: int


def final_messages(db: Database, trajectory_ids: Sequence[int]) -> dict[int, str]:
    """The last model message of each trajectory: what the graders judge."""
    with db.begin() as s:
        last = (sa.select(Turn.trajectory_id, sa.func.max(Turn.turn_index).label("turn_index"))
                .where(Turn.trajectory_id.in_(trajectory_ids)).group_by(Turn.trajectory_id).subquery())
        rows = s.execute(sa.select(Turn.trajectory_id, Turn.output_text).join(
            last, sa.and_(Turn.trajectory_id == last.c.trajectory_id, Turn.turn_index == last.c.turn_index)))
        texts = {row.trajectory_id: row.output_text for row in rows}
    missing = set(trajectory_ids) - set(texts)
    if missing:
        raise LookupError(f"trajectories {sorted(missing)} have no model turn to grade")
    return texts


def conversations(db: Database, trajectory_ids: Sequence[int]) -> dict[int, str]:
    """Each trajectory's episode as `graders.conversation` text: its model messages and tool results."""
    with db.begin() as s:
        turns = s.execute(sa.select(Turn.trajectory_id, Turn.output_text, Turn.tool_calls)
                          .where(Turn.trajectory_id.in_(trajectory_ids))
                          .order_by(Turn.trajectory_id, Turn.turn_index)).all()
    messages: dict[int, list[dict]] = {t: [] for t in trajectory_ids}
    for turn in turns:
        messages[turn.trajectory_id] += stored_turn_messages(turn.output_text, turn.tool_calls)
    return {t: conversation_text(m) for t, m in messages.items()}


async def grade_group(db: Database, task: Task, trajectory_ids: Sequence[int], rubric: Rubric,
                      graders: dict[str, Grader], concurrency: int) -> GroupGrades:
    """Rewards (rubric-weighted grader scores) of the trajectories, in the given order."""
    texts = await asyncio.to_thread(final_messages, db, trajectory_ids)
    episodes = {}
    if any(graders[name].reads_conversation for name in rubric.weights):
        episodes = await asyncio.to_thread(conversations, db, trajectory_ids)
    limit = asyncio.Semaphore(concurrency)
    hits = 0

    async def one(trajectory_id: int, name: str) -> tuple[int, str, float]:
        nonlocal hits
        grader = graders[name]
        async with limit:
            started = time.monotonic()
            text = (episodes if grader.reads_conversation else texts)[trajectory_id]
            cache = PostgresGradeCache(db, grader.name, grader.version)
            result, hit = await grade_with_cache(grader, cache, task, text)
            latency = time.monotonic() - started
        hits += hit
        METRICS.observe_grade(grader.name, latency, hit)
        await asyncio.to_thread(_store_grade, db, trajectory_id, grader, result.score, result.details, latency, hit)
        return trajectory_id, name, result.score

    scored = await asyncio.gather(*(one(t, name) for t in trajectory_ids for name in rubric.weights))
    scores: dict[int, dict[str, float]] = {t: {} for t in trajectory_ids}
    for trajectory_id, name, score in scored:
        scores[trajectory_id][name] = score
    rewards = [rubric.reward(scores[t]) for t in trajectory_ids]
    await asyncio.to_thread(_store_rewards, db, dict(zip(trajectory_ids, rewards, strict=True)))
    return GroupGrades(rewards, hits)


def _store_grade(db: Database, trajectory_id: int, grader: Grader, score: float, details: dict, latency: float,
                 hit: bool) -> None:
    with db.begin() as s:
        s.execute(insert(Grade).values(trajectory_id=trajectory_id, grader=grader.name, grader_version=grader.version,
                                       score=score, details=details, latency_s=latency, cache_hit=hit)
                  .on_conflict_do_nothing(constraint="uq_grades_trajectory_id_grader"))


def _store_rewards(db: Database, rewards: dict[int, float]) -> None:
    with db.begin() as s:
        for trajectory_id, reward in rewards.items():
            s.execute(sa.update(Trajectory).where(Trajectory.id == trajectory_id).values(reward=reward))
