"""Trainer activities (trainer queue, one at a time): publish the base policy, run a step."""

from __future__ import annotations

import asyncio

from temporalio import activity

from rlpipe.activities.common import heartbeating, instrumented
from rlpipe.activities.definitions import INIT_POLICY, TRAIN_STEP
from rlpipe.observe.metrics import METRICS
from rlpipe.schemas.payloads import InitPolicyInput, PublishedVersion, StepSummary, TrainStepInput
from rlpipe.storage.db import Database
from rlpipe.trainer.trainer import Trainer


class TrainingActivities:
    def __init__(self, db: Database, trainer: Trainer) -> None:
        self.db = db
        self.trainer = trainer

    @activity.defn(name=INIT_POLICY.name)
    @instrumented("trainer", "train")
    async def init_policy(self, inp: InitPolicyInput) -> PublishedVersion:
        return await heartbeating(asyncio.to_thread(self.trainer.init_policy, inp.run_id))

    @activity.defn(name=TRAIN_STEP.name)
    @instrumented("trainer", "train")
    async def train_step(self, inp: TrainStepInput) -> StepSummary:
        summary = await heartbeating(asyncio.to_thread(self.trainer.train_step, inp))
        METRICS.observe_train_step(inp.run_id, summary.step, summary.duration_s, summary.n_tokens,
                                   staleness=summary.staleness, reward_mean=summary.reward_mean,
                                   entropy=summary.entropy, kl_sampler=summary.kl_sampler,
                                   response_length=summary.response_length)
        if summary.published is not None:
            METRICS.observe_publish(inp.run_id, summary.published.version)
        return summary
