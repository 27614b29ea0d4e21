"""Rollout activities (rollout queue): open a group, generate one model turn, close the group."""

from __future__ import annotations

import asyncio

from temporalio import activity

from rlpipe.activities.common import heartbeating, instrumented
from rlpipe.activities.definitions import CHECK_TASKS, FINISH_GROUP, GENERATE, START_GROUP
from rlpipe.inference.client import InferenceClient
from rlpipe.inference.directory import ServerDirectory
from rlpipe.infra.inference import SERVED_MODEL_NAME
from rlpipe.observe.metrics import METRICS
from rlpipe.rl.advantages import compute_advantages, shaped_rewards, uninformative
from rlpipe.rollout.assemble import assemble
from rlpipe.rollout.context import RunContexts, draw_task
from rlpipe.rollout.generation import plan_turn, sample_turn, turn_row
from rlpipe.rollout.tokens import request_seed
from rlpipe.schemas.config import RunConfig
from rlpipe.schemas.payloads import (
    FinishGroupInput,
    GenerateInput,
    GenerateResult,
    GroupSummary,
    RunCheckInput,
    StartGroupInput,
    StartGroupResult,
)
from rlpipe.schemas.tables import Turn
from rlpipe.storage import buffer
from rlpipe.storage.db import Database
from rlpipe.weights.labels import settle_completion, verdicts


class RolloutActivities:
    def __init__(self, db: Database, contexts: RunContexts, servers: ServerDirectory) -> None:
        self.db = db
        self.contexts = contexts
        self.servers = servers
        self._clients: dict[tuple[str, str], InferenceClient] = {}

    async def client(self, server: str, model: str) -> InferenceClient:
        key = (server, model)
        if key not in self._clients:
            # the token route: exact weight-version spans per token (a sync may happen mid-request)
            self._clients[key] = InferenceClient(await self.servers.url(server), model, route="generate")
        return self._clients[key]

    @activity.defn(name=CHECK_TASKS.name)
    @instrumented("rollout", "config")
    async def check_tasks(self, inp: RunCheckInput) -> None:
        """Fail the run at its start, with the environment's own reason, if it cannot produce the
        first train task or its eval set; groups would otherwise fail one by one."""
        ctx = self.contexts.get(inp.run_id)
        from rlpipe.policy.chat import chat_prompt_ids

        def check() -> None:
            for index in range(ctx.env.size("eval")):
                draw_task(ctx.env, "eval", index)
            chat_prompt_ids(ctx.tokenizer, ctx.env.initial_messages(draw_task(ctx.env, "train", 0)))

        await asyncio.to_thread(check)

    @activity.defn(name=START_GROUP.name)
    @instrumented("persist", "rollout")
    async def start_group(self, inp: StartGroupInput) -> StartGroupResult:
        ctx = self.contexts.get(inp.run_id)
        task = draw_task(ctx.env, "train", inp.group_index % ctx.env.size("train"))
        from rlpipe.policy.chat import chat_prompt_ids

        prompt_ids = chat_prompt_ids(ctx.tokenizer, ctx.env.initial_messages(task))

        def write() -> list[int]:
            with self.db.begin() as s:
                return buffer.start_group(s, run_id=inp.run_id, group_index=inp.group_index, prompt_index=task.index,
                                          task_id=task.id, workflow_id=inp.workflow_id, n_samples=inp.n_samples,
                                          prompt_ids=prompt_ids)

        return StartGroupResult(trajectory_ids=await asyncio.to_thread(write), task_id=task.id)

    @activity.defn(name=GENERATE.name)
    @instrumented("rollout", "generate")
    async def generate(self, inp: GenerateInput) -> GenerateResult:
        ctx = self.contexts.get(inp.run_id)

        def load() -> buffer.TrajectoryContext:
            with self.db.begin() as s:
                return buffer.trajectory_context(s, inp.trajectory_id)

        trajectory = await asyncio.to_thread(load)
        if inp.turn_index < len(trajectory.turns):  # done before a crash: never generated again
            return _summary(trajectory.turns[inp.turn_index], ctx.env.max_turns)
        task = ctx.env.task("train", trajectory.prompt_index)
        plan = plan_turn(trajectory, inp.turn_index, ctx.env, ctx.tokenizer)
        seed = request_seed(ctx.config.sampling.seed, inp.run_id, trajectory.group_index, trajectory.sample_index,
                            inp.turn_index)
        completion, latency = await heartbeating(sample_turn(
            await self.client(inp.server, SERVED_MODEL_NAME), plan, ctx.config, ctx.env, ctx.tokenizer, seed))
        # tokens sampled while a sync verified new weights count once that sync's verdict is "ok"
        # (keep mode: a request spanning a sync then records both versions); else the turn is retried
        completion = await heartbeating(settle_completion(completion, verdicts(self.db, inp.run_id, inp.server)))
        row = turn_row(trajectory, inp.turn_index, plan, completion, latency, inp.server, ctx.env, task,
                       last_turn=inp.turn_index + 1 >= ctx.env.max_turns)

        def save() -> Turn:
            with self.db.begin() as s:
                return buffer.save_turn(s, row)

        turn = await asyncio.to_thread(save)
        METRICS.observe_generation(inp.run_id, len(turn.output_ids))
        return _summary(turn, ctx.env.max_turns)

    @activity.defn(name=FINISH_GROUP.name)
    @instrumented("persist", "persist")
    async def finish_group(self, inp: FinishGroupInput) -> GroupSummary:
        ctx = self.contexts.get(inp.run_id)

        def write() -> GroupSummary:
            with self.db.begin() as s:
                turns = [buffer.trajectory_context(s, trajectory_id).turns for trajectory_id in inp.trajectory_ids]
                trajectories = [assemble([buffer.turn_tokens(t) for t in ts]) for ts in turns]
                rewards = shaped_rewards(inp.rewards, [sum(t.loss_mask) for t in trajectories],
                                         ctx.config.advantage.overlong)
                advantages = _group_advantages(rewards, ctx.config)
                samples = [buffer.FinishedSample(trajectory_id, reward, advantage, trajectory, ts[-1].finish_reason,
                                                 len(ts))
                           for trajectory_id, reward, advantage, trajectory, ts
                           in zip(inp.trajectory_ids, rewards, advantages, trajectories, turns, strict=True)]
                status, reason = inp.status, inp.reason
                if status == "completed" and ctx.config.rollout.dynamic_sampling and uninformative(rewards):
                    status, reason = buffer.admit_uninformative(s, run_id=inp.run_id, group_index=inp.group_index,
                                                                rewards=rewards,
                                                                budget=ctx.config.rollout.dynamic_sampling_budget)
                group = buffer.finish_group(s, run_id=inp.run_id, group_index=inp.group_index, samples=samples,
                                            discarded_ids=inp.discarded_ids, status=status, reason=reason)
                return GroupSummary(group.group_index, group.status, group.min_version, group.n_completed,
                                    group.reward_mean, group.status_reason)

        summary = await asyncio.to_thread(write)
        METRICS.observe_group(inp.run_id, summary.status, ["completed"] * summary.n_samples)
        return summary


def _group_advantages(rewards: list[float], config: RunConfig) -> list[float | None]:
    """Group-relative advantages, computed once when the group completes. A batch-level estimator
    (batch_whitened) needs the whole step's batch, so the trainer computes it at claim time."""
    if not rewards or config.advantage.kind == "batch_whitened":
        return [None] * len(rewards)
    return compute_advantages(rewards, [0] * len(rewards), config.advantage).tolist()


def _summary(turn: Turn, max_turns: int) -> GenerateResult:
    calls = len(turn.tool_calls or [])
    return GenerateResult(n_tool_calls=calls, done=calls == 0 or turn.turn_index + 1 >= max_turns,
                          n_tokens=len(turn.output_ids), version=turn.version_before,
                          finish_reason=turn.finish_reason or "")
