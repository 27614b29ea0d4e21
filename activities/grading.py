"""The grading activity (grader queue): grade a finished group with the run's rubric."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa
from temporalio import activity

from rlpipe.activities.common import heartbeating, instrumented
from rlpipe.activities.definitions import GRADE_GROUP
from rlpipe.envs.base import Rubric
from rlpipe.graders.base import Grader, GraderDeps
from rlpipe.graders.registry import build_rubric_graders
from rlpipe.grading.group import grade_group
from rlpipe.rollout.context import RunContexts
from rlpipe.schemas.payloads import GradeGroupInput, GradeGroupResult
from rlpipe.schemas.tables import RolloutGroup
from rlpipe.storage.db import Database


class GradingActivities:
    def __init__(self, db: Database, contexts: RunContexts, deps: GraderDeps) -> None:
        self.db = db
        self.contexts = contexts
        self.deps = deps
        self._graders: dict[str, tuple[Rubric, dict[str, Grader]]] = {}

    def graders(self, run_id: str) -> tuple[Rubric, dict[str, Grader]]:
        if run_id not in self._graders:
            ctx = self.contexts.get(run_id)
            self._graders[run_id] = build_rubric_graders(ctx.env.rubric, ctx.config.grader, self.deps)
        return self._graders[run_id]

    @activity.defn(name=GRADE_GROUP.name)
    @instrumented("grader", "grade")
    async def grade_group(self, inp: GradeGroupInput) -> GradeGroupResult:
        ctx = self.contexts.get(inp.run_id)

        def prompt_index() -> int:
            with self.db.begin() as s:
                return s.execute(sa.select(RolloutGroup.prompt_index).where(
                    RolloutGroup.run_id == inp.run_id, RolloutGroup.group_index == inp.group_index)).scalar_one()

        task = ctx.env.task("train", await asyncio.to_thread(prompt_index))
        rubric, graders = self.graders(inp.run_id)
        grades = await heartbeating(grade_group(self.db, task, inp.trajectory_ids, rubric, graders,
                                                ctx.config.grader.concurrency))
        return GradeGroupResult(grades.rewards, grades.cache_hits)
