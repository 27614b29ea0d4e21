"""The sandbox as the environments' `Executor` (envs.base): run code with a wall-clock limit."""

from __future__ import annotations

from rlpipe.sandbox.result import SandboxResult
from rlpipe.sandbox.runner import Sandbox


class SandboxExecutor:
    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    async def __call__(self, code: str, *, timeout_s: float) -> SandboxResult:
        limits = self.sandbox.config.limits.model_copy(update={"wall_seconds": timeout_s})
        return await self.sandbox.run(code, limits=limits)
