"""The sandbox's public API: `await Sandbox(config).run(code)` runs untrusted Python and returns a result.

The run_tool activity (later) and the environments call this. It never blocks the event loop (every
process is driven by asyncio), bounds how many runs execute at once, adds the configured injected
latency, and takes sandboxes from the warm pool when there is one. Whatever the code does, the caller
gets a SandboxResult; only misuse of the API (e.g. running after close) raises.
"""

import asyncio
import time
from dataclasses import replace

from rlpipe.sandbox.config import SandboxConfig
from rlpipe.sandbox.latency import LatencyInjector
from rlpipe.sandbox.limits import SandboxLimits
from rlpipe.sandbox.pool import SandboxPool
from rlpipe.sandbox.process import SandboxProcess, SandboxSetupError
from rlpipe.sandbox.result import SandboxResult
from rlpipe.sandbox.uids import UidExhaustedError


class Sandbox:
    """Isolated single-use executions for one event loop. Use `async with Sandbox(config) as sandbox:`."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._pool = SandboxPool(self.config) if self.config.pool_size else None
        self._latency = LatencyInjector(self.config.latency)
        self._slots = asyncio.Semaphore(self.config.max_concurrent_runs)
        self._closed = False

    @property
    def pool(self) -> SandboxPool | None:
        """The warm pool (None when pool_size is 0): ready_count and last_error are for metrics."""
        return self._pool

    async def __aenter__(self) -> "Sandbox":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Fill the warm pool (no-op without one), so the first runs are already warm."""
        if self._pool is not None:
            await self._pool.start()

    async def close(self) -> None:
        """Kill the idle pool sandboxes; runs in progress finish on their own."""
        self._closed = True
        if self._pool is not None:
            await self._pool.close()

    async def run(self, code: str, *, stdin: str | bytes = b"", limits: SandboxLimits | None = None) -> SandboxResult:
        """Run Python source once in a fresh sandbox; limits default to config.limits."""
        if self._closed:
            raise RuntimeError("this Sandbox is closed: create a new one")
        limits = limits or self.config.limits
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else stdin
        delay = await self._latency.sleep()  # before taking a slot: a remote call's wait costs no local slot
        async with self._slots:
            asked = time.perf_counter()
            try:
                if self._pool is not None:
                    sandbox, warm = await self._pool.acquire()
                else:
                    sandbox, warm = await SandboxProcess.spawn(self.config), False
            except (SandboxSetupError, UidExhaustedError, OSError) as exc:
                return replace(SandboxResult.not_started(f"sandbox setup failed: {exc}",
                                                         time.perf_counter() - asked),
                               injected_latency_seconds=delay)
            startup = time.perf_counter() - asked
            result = await sandbox.execute(code, stdin_bytes, limits)
        return replace(result, startup_seconds=startup, warm=warm, injected_latency_seconds=delay)


async def run(code: str, *, stdin: str | bytes = b"", limits: SandboxLimits | None = None,
              config: SandboxConfig | None = None) -> SandboxResult:
    """One cold run without a pool: for scripts and one-off checks (a worker keeps one Sandbox instead)."""
    config = (config or SandboxConfig()).model_copy(update={"pool_size": 0})
    async with Sandbox(config) as sandbox:
        return await sandbox.run(code, stdin=stdin, limits=limits)
