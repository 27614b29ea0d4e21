"""The tool activity (sandbox queue): run one tool call of a turn and store its result."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from temporalio import activity

from rlpipe.activities.common import heartbeating, instrumented
from rlpipe.activities.definitions import RUN_TOOL
from rlpipe.envs.base import Executor
from rlpipe.envs.toolcalls import ToolCall
from rlpipe.observe.metrics import METRICS
from rlpipe.rollout.context import RunContexts
from rlpipe.sandbox.latency import LatencyInjector
from rlpipe.schemas.payloads import ToolInput, ToolResult
from rlpipe.storage import buffer
from rlpipe.storage.db import Database


class ToolActivities:
    def __init__(self, db: Database, contexts: RunContexts, executor: Executor) -> None:
        self.db = db
        self.contexts = contexts
        self.executor = executor
        self._latency: dict[str, LatencyInjector] = {}

    def latency(self, run_id: str) -> LatencyInjector:
        if run_id not in self._latency:
            self._latency[run_id] = LatencyInjector(self.contexts.get(run_id).config.rollout.tool_latency)
        return self._latency[run_id]

    @activity.defn(name=RUN_TOOL.name)
    @instrumented("sandbox", "tool")
    async def run_tool(self, inp: ToolInput) -> ToolResult:
        ctx = self.contexts.get(inp.run_id)

        def load() -> dict[str, Any]:
            with self.db.begin() as s:
                return dict((buffer.get_turn(s, inp.trajectory_id, inp.turn_index).tool_calls or [])[inp.call_index])

        call = await asyncio.to_thread(load)
        if call.get("result") is not None:  # ran before a crash: never run again
            return ToolResult(call["result"]["status"], call["result"]["latency_s"])
        started = time.monotonic()
        await self.latency(inp.run_id).sleep()
        outcome = await heartbeating(ctx.env.run_tool(ToolCall(call["name"], call["arguments"], call.get("error")),
                                                      self.executor))
        output = outcome.output if isinstance(outcome.output, str) else outcome.output.decode("utf-8", "replace")
        result = {"ok": outcome.ok, "output": output.replace("\x00", "\ufffd"), "reason": outcome.reason,
                  "status": "ok" if outcome.ok else "error", "latency_s": time.monotonic() - started}

        def save() -> dict[str, Any]:
            with self.db.begin() as s:
                return buffer.save_tool_result(s, inp.trajectory_id, inp.turn_index, inp.call_index, result)

        stored = await asyncio.to_thread(save)
        METRICS.observe_tool_call(call["name"], stored["latency_s"])
        return ToolResult(stored["status"], stored["latency_s"])
