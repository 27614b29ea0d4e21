"""Isolated execution of untrusted tool code (model-written Python) for agentic rollouts.

    async with Sandbox(SandboxConfig(pool_size=4)) as sandbox:
        result = await sandbox.run("print(2 + 2)", limits=SandboxLimits(wall_seconds=5))
        result.status, result.stdout   # ("ok", "4\\n")

Each run gets fresh network/mount/pid/ipc/uts namespaces, a root filesystem of read-only system dirs
plus a private size-capped tmpfs workdir, its own unprivileged uid, rlimits and a wall-clock kill.
Needs root (CAP_SYS_ADMIN) on Linux; without it every run fails closed with status "sandbox_error".
Plain library: no temporalio import; the run_tool activity wraps it.
"""

from rlpipe.sandbox.config import SandboxConfig
from rlpipe.sandbox.latency import (
    ConstantLatency,
    LatencyInjector,
    LatencyModel,
    LognormalLatency,
    NoLatency,
    TraceLatency,
)
from rlpipe.sandbox.limits import SandboxLimits
from rlpipe.sandbox.pool import SandboxPool
from rlpipe.sandbox.result import SandboxResult, SandboxStatus
from rlpipe.sandbox.runner import Sandbox, run

__all__ = [
    "ConstantLatency", "LatencyInjector", "LatencyModel", "LognormalLatency", "NoLatency", "Sandbox",
    "SandboxConfig", "SandboxLimits", "SandboxPool", "SandboxResult", "SandboxStatus", "TraceLatency", "run",
]
