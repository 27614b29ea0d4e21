"""Run registration, run status and the failure log (workflow queue; database only)."""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.exceptions import ApplicationError

from rlpipe.activities.definitions import (
    CHECK_SERVER,
    RECORD_FAILURE,
    RECORD_REJECTED_RUN,
    REGISTER_RUN,
    SET_RUN_STATUS,
)
from rlpipe.inference.directory import ServerDirectory, UnknownServer
from rlpipe.schemas.config import RunConfig
from rlpipe.schemas.payloads import FailureRecord, JoinRequest, RegisterRunResult, RejectedRun, RunStatusUpdate
from rlpipe.storage.db import Database
from rlpipe.storage.runs import record_failure, record_rejected_run, register_run, set_run_status


class BookkeepingActivities:
    def __init__(self, db: Database, servers: ServerDirectory) -> None:
        self.db = db
        self.servers = servers
        """A run starts on the configured servers; others can join it by name (`check_server`)."""

    @activity.defn(name=REGISTER_RUN.name)
    async def register_run(self, config: RunConfig) -> RegisterRunResult:
        workflow_id = activity.info().workflow_id  # the Web UI may have chosen another id than run-<name>

        def write() -> None:
            with self.db.begin() as s:
                register_run(s, config, workflow_id)

        await asyncio.to_thread(write)
        return RegisterRunResult(servers=sorted(self.servers.configured))

    @activity.defn(name=CHECK_SERVER.name)
    async def check_server(self, request: JoinRequest) -> None:
        try:
            await self.servers.url(request.server)
        except UnknownServer as exc:
            raise ApplicationError(str(exc), type="UnknownServer", non_retryable=True) from exc

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
