"""A warm pool: sandboxes started ahead of time so a tool call skips the start-up.

Starting a sandbox (an interpreter, namespaces, mounts, a second interpreter) is most of the latency of a
short tool call. The pool keeps `pool_size` of them blocked on stdin. Each is handed out once and a
replacement starts in the background, so isolation is exactly that of a cold start: one process tree,
one uid, one tmpfs per execution, never reused.
"""

import asyncio
import logging
from collections import deque
from collections.abc import Coroutine
from typing import Any

from rlpipe.sandbox.config import SandboxConfig
from rlpipe.sandbox.process import SandboxProcess, SandboxSetupError
from rlpipe.sandbox.uids import UidExhaustedError

log = logging.getLogger(__name__)
RETRY_FIRST_SECONDS, RETRY_MAX_SECONDS = 0.5, 30.0  # a failing start is retried, doubling the wait


class SandboxPool:
    """Ready sandboxes for one event loop; `acquire` never waits for a refill, it starts one cold instead."""

    def __init__(self, config: SandboxConfig) -> None:
        self._config = config
        self._ready: deque[SandboxProcess] = deque()
        self._tasks: set[asyncio.Task[None]] = set()  # refills and idle watchers
        self._refilling = 0
        self._settled = asyncio.Event()  # set after every start attempt, for start()
        self._closed = False
        self.last_error: str | None = None
        """Why the latest background start failed (None once one succeeds): for metrics and `doctor`."""

    @property
    def ready_count(self) -> int:
        """Sandboxes waiting for code right now (one that dies while idle is dropped and replaced)."""
        return len(self._ready)

    async def start(self) -> None:
        """Fill the pool: returns once it is full (the first runs are warm) or once a start has failed
        (see last_error; refills keep retrying), so a host that cannot isolate never hangs the caller."""
        self._top_up()
        while len(self._ready) < self._config.pool_size and self.last_error is None and not self._closed:
            self._settled.clear()
            await self._settled.wait()

    async def acquire(self) -> tuple[SandboxProcess, bool]:
        """A sandbox for exactly one execution, and whether it came warm from the pool."""
        if self._closed:
            raise RuntimeError("the sandbox pool is closed")
        while self._ready:
            sandbox = self._ready.popleft()
            self._top_up()
            if sandbox.alive:
                return sandbox, True
            await sandbox.discard()  # died after its watcher last ran: never hand it out
        return await SandboxProcess.spawn(self._config), False

    def _top_up(self) -> None:
        """Start background refills until ready + starting reaches pool_size."""
        while not self._closed and len(self._ready) + self._refilling < self._config.pool_size:
            self._refilling += 1
            self._spawn_task(self._refill())

    def _spawn_task(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run a background coroutine; keep a reference so it is not collected and can be cancelled."""
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refill(self) -> None:
        """Start one sandbox for the pool, retrying with backoff so the pool never stays short for good."""
        wait = RETRY_FIRST_SECONDS
        try:
            while True:
                try:
                    sandbox = await SandboxProcess.spawn(self._config)
                    break
                except (SandboxSetupError, UidExhaustedError, OSError) as exc:
                    self.last_error = str(exc)
                    self._settled.set()
                    log.warning("warm sandbox failed to start (retry in %.1f s): %s", wait, exc)
                    await asyncio.sleep(wait)
                    wait = min(2 * wait, RETRY_MAX_SECONDS)
        finally:
            self._refilling -= 1
        self.last_error = None
        if self._closed:
            await sandbox.discard()
            return
        self._ready.append(sandbox)
        self._settled.set()
        self._spawn_task(self._evict_when_dead(sandbox))

    async def _evict_when_dead(self, sandbox: SandboxProcess) -> None:
        """Drop an idle sandbox whose process tree exits (e.g. killed from outside) and replace it."""
        await sandbox.exited()
        if sandbox in self._ready:
            self._ready.remove(sandbox)
            await sandbox.discard()
            self._top_up()

    async def close(self) -> None:
        """Stop refilling and kill every idle sandbox (idempotent)."""
        self._closed = True
        while self._ready:
            await self._ready.popleft().discard()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
