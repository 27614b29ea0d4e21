"""Run registration, run status and the failure log (workflow queue; database only)."""

from __future__ import annotations

import asyncio

from temporalio import activity

from rlpipe.activities.definitions import RECORD_FAILURE, RECORD_REJECTED_RUN, REGISTER_RUN, SET_RUN_STATUS
from rlpipe.schemas.config import RunConfig
from rlpipe.schemas.payloads import FailureRecord, RegisterRunResult, RejectedRun, RunStatusUpdate
from rlpipe.storage.db import Database
from rlpipe.storage.runs import record_failure, record_rejected_run, register_run, set_run_status


class BookkeepingActivities:
    def __init__(self, db: Database, servers: list[str]) -> None:
        self.db = db
        self.servers = servers

    @activity.defn(name=REGISTER_RUN.name)
    async def register_run(self, config: RunConfig) -> RegisterRunResult:
        workflow_id = activity.info().workflow_id  # the Web UI may have chosen another id than run-<name>

        def write() -> None:
            with self.db.begin() as s:
                register_run(s, config, workflow_id)

        await asyncio.to_thread(write)
        return RegisterRunResult(servers=self.servers)

    @activity.defn(name=SET_RUN_STATUS.name)
    async def set_run_status(self, update: RunStatusUpdate) -> None:
        def write() -> None:
            with self.db.begin() as s:
                set_run_status(s, update.run_id, update.status, update.reason)

        await asyncio.to_thread(write)

    @activity.defn(name=RECORD_FAILURE.name)
    async def record_failure(self, record: FailureRecord) -> None:
        def write() -> None:
            with self.db.begin() as s:
                record_failure(s, run_id=record.run_id, kind=record.kind, error_type=record.error_type,
                               message=record.message, workflow_id=record.workflow_id,
                               activity_id=record.activity_id, details=dict(record.details))

        await asyncio.to_thread(write)

    @activity.defn(name=RECORD_REJECTED_RUN.name)
    async def record_rejected_run(self, rejected: RejectedRun) -> None:
        def write() -> None:
            with self.db.begin() as s:
                run_id = record_rejected_run(s, workflow_id=rejected.workflow_id, config=rejected.config,
                                             reason=rejected.reason)
                record_failure(s, run_id=run_id, kind="config", error_type="ConfigError", message=rejected.reason,
                               workflow_id=rejected.workflow_id, activity_id="validate-config")

        await asyncio.to_thread(write)
