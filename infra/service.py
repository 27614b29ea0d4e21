"""The shape every local service of the stack has: ports, a one-time prepare, a command, a
health check. `stack.py` drives them; each server's file says only what is particular to it."""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from rlpipe.infra.settings import StackSettings


class HealthError(RuntimeError):
    """A service is not (yet) healthy; the message says what the check saw."""


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    cwd: Path | None = None


class Service(ABC):
    name: str
    startup_timeout_s: float = 60.0
    stop_signal: signal.Signals = signal.SIGTERM
    stop_timeout_s: float = 30.0
    """Grace period after stop_signal before SIGKILL."""
    reap_orphans: bool = False
    """Whether the server's children outlive its main process (vLLM's engine core does): it is
    then started under a reaper that stops them when the main process exits (session_reaper.py)."""

    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings

    @property
    def dir(self) -> Path:
        return self.settings.service_dir(self.name)

    @property
    def log(self) -> Path:
        return self.dir / f"{self.name}.log"

    @abstractmethod
    def ports(self) -> list[int]:
        """Every port the service listens on (checked free before start)."""

    @abstractmethod
    def address(self) -> str:
        """What a client connects to (URL or host:port), secrets left out."""

    def prepare(self) -> None:
        """One-time set-up before the first start (data directory, config files)."""

    @abstractmethod
    def launch(self) -> Launch:
        """The command line that runs the server in the foreground."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise HealthError unless the service answers real requests."""

    def after_start(self) -> None:
        """Idempotent set-up that needs the running server (databases, buckets)."""
