"""Per-run resource limits of one sandboxed execution, and how they map onto setrlimit."""

from pydantic import BaseModel, ConfigDict, Field

MiB = 1024 * 1024


class SandboxLimits(BaseModel):
    """What one execution may use. The defaults fit tool calls and unit-test runs of model-written code."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_seconds: float = Field(10.0, gt=0, le=3600, allow_inf_nan=False)
    """Wall-clock limit from the moment the request is sent; past it the whole process tree is killed."""
    cpu_seconds: int = Field(5, ge=1, le=3600)
    """RLIMIT_CPU per process (whole seconds: the kernel's granularity); SIGXCPU at the limit, SIGKILL 1 s later."""
    memory_bytes: int = Field(512 * MiB, ge=64 * MiB)
    """RLIMIT_AS: address space per process. Python raises MemoryError; below ~64 MiB it cannot start."""
    max_processes: int = Field(32, ge=1, le=4096)
    """RLIMIT_NPROC: processes and threads of the run's uid. Each run has its own uid, so runs never share it."""
    max_file_bytes: int = Field(16 * MiB, ge=MiB)
    """RLIMIT_FSIZE: largest file the code may write (Python ignores SIGXFSZ and raises OSError instead)."""
    max_open_files: int = Field(64, ge=16, le=65536)
    """RLIMIT_NOFILE; the interpreter itself needs a handful."""
    max_output_bytes: int = Field(64 * 1024, ge=0, le=64 * MiB)
    """Bytes kept per stream (stdout, stderr); one more byte kills the run with status output_limit."""

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """setrlimit arguments by resource name, applied by the stub before any of the code runs."""
        return {
            "RLIMIT_CPU": (self.cpu_seconds, self.cpu_seconds + 1),  # soft: SIGXCPU; hard: SIGKILL
            "RLIMIT_AS": (self.memory_bytes, self.memory_bytes),
            "RLIMIT_NPROC": (self.max_processes, self.max_processes),
            "RLIMIT_FSIZE": (self.max_file_bytes, self.max_file_bytes),
            "RLIMIT_NOFILE": (self.max_open_files, self.max_open_files),
            "RLIMIT_CORE": (0, 0),  # a crash must not write a core file
        }
