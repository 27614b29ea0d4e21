"""SandboxConfig: everything a sandbox worker needs to know, with defaults that work as root on Linux."""

import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlpipe.sandbox.latency import LatencyModel, NoLatency
from rlpipe.sandbox.limits import MiB, SandboxLimits

UID_MAX = 2**32 - 2  # (uid_t)-1 means "unchanged" to setresuid


class SandboxConfig(BaseModel):
    """Limits, warm pool, injected latency and where the sandbox keeps its host-side state."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- per run ---
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    """Default limits of every run; `Sandbox.run(..., limits=...)` overrides them for one call."""
    workdir_bytes: int = Field(64 * MiB, ge=MiB)
    """Size of the run's private tmpfs workdir (its only writable place); fixed when the sandbox starts."""
    extra_readonly_paths: tuple[Path, ...] = ()
    """Host paths shown read-only inside, besides /usr, /bin, /lib* and the interpreter's prefix.
    Each must exist: a missing one fails every run (closed), it is never skipped."""

    # --- throughput ---
    pool_size: int = Field(2, ge=0, le=256)
    """Sandboxes kept started and waiting for code; each is used once and replaced. 0: every run starts cold."""
    max_concurrent_runs: int = Field(16, ge=1, le=1024)
    """Runs executing at once; more wait. Bounds processes and memory on a small worker box."""
    latency: LatencyModel = Field(default_factory=NoLatency)
    """Delay added before each run to emulate a remote sandbox; see sandbox/latency.py."""

    # --- host-side state ---
    scratch_root: Path = Path(tempfile.gettempdir()) / "rlpipe-sandbox"
    """Root-owned directory for uid leases and the (empty, mount-point only) per-run staging dirs."""
    uid_range_start: int = Field(1_500_000, ge=100_000, le=UID_MAX)
    """First uid leased to runs; every live sandbox gets its own uid, so limits and files never mix.
    Kept far above the uids of real accounts (which `useradd` allocates from 1000)."""
    uid_range_size: int = Field(4096, ge=1)
    spawn_timeout_seconds: float = Field(15.0, gt=0, allow_inf_nan=False)
    """How long starting one sandbox may take before it counts as failed (2 cores under load: ~0.1 s)."""

    @model_validator(mode="after")
    def _uid_range_fits(self) -> "SandboxConfig":
        if self.uid_range_start + self.uid_range_size - 1 > UID_MAX:
            raise ValueError(f"uid range ends past {UID_MAX}: lower uid_range_start or uid_range_size")
        if self.uid_range_size < self.pool_size + self.max_concurrent_runs:
            raise ValueError("uid_range_size must be >= pool_size + max_concurrent_runs: every idle pool "
                             "sandbox and every running one holds its own uid")
        return self
