"""The evaluation activity (grader queue: it has the sandbox and HTTP clients graders need):
greedy held-out accuracy of the version a server holds, recorded in `eval_results`."""

from __future__ import annotations

import asyncio

from temporalio import activity

from rlpipe.activities.common import heartbeating, instrumented
from rlpipe.activities.definitions import EVALUATE
from rlpipe.envs.base import Executor
from rlpipe.evaluation.heldout import evaluate_served_version
from rlpipe.graders.base import GraderDeps
from rlpipe.graders.registry import build_rubric_graders
from rlpipe.inference.client import InferenceClient
from rlpipe.inference.directory import ServerDirectory
from rlpipe.infra.inference import SERVED_MODEL_NAME
from rlpipe.rollout.context import RunContexts
from rlpipe.schemas.payloads import EvalInput, EvalSummary
from rlpipe.storage.db import Database
from rlpipe.storage.evals import record_eval


class EvaluationActivities:
    def __init__(self, db: Database, contexts: RunContexts, servers: ServerDirectory, executor: Executor,
                 deps: GraderDeps) -> None:
        self.db = db
        self.contexts = contexts
        self.servers = servers
        self.executor = executor
        self.deps = deps

    @activity.defn(name=EVALUATE.name)
    @instrumented("grader", "eval")
    async def evaluate(self, inp: EvalInput) -> EvalSummary:
        ctx = self.contexts.get(inp.run_id)
        rubric, graders = build_rubric_graders(ctx.env.rubric, ctx.config.grader, self.deps)
        async with InferenceClient(await self.servers.url(inp.server), SERVED_MODEL_NAME, route="generate") as client:
            outcome = await heartbeating(evaluate_served_version(
                client, ctx.env, ctx.tokenizer, self.executor, rubric, graders, inp.version, ctx.config.eval.prompts,
                ctx.config.eval.max_tokens, ctx.config.model.max_model_len))
        low, high = outcome.interval

        def write() -> None:
            with self.db.begin() as s:
                record_eval(s, run_id=inp.run_id, version=inp.version, split="eval", n_prompts=outcome.n_prompts,
                            n_correct=outcome.n_correct, mean_reward=outcome.mean_reward,
                            details={"ci95": [low, high], "server": inp.server})

        await asyncio.to_thread(write)
        return EvalSummary(inp.version, outcome.n_prompts, outcome.accuracy, low, high)
