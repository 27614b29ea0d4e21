"""The grader interface: a task and the policy's final message in, a validated reward in [0, 1] out.

Every grader checks its own output before anyone stores it: a NaN, an infinity or a score outside
[0, 1] would silently poison the group's advantages, so it raises `InvalidGrade` instead, naming
the grader and the value. `InvalidGrade` is deterministic (grading again gives the same), so the
caller records it in `failures` rather than retrying; any other exception (an HTTP error, a sandbox
outage) is infrastructure and is worth a retry.
"""

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from rlpipe.envs.base import Executor, Task
from rlpipe.schemas.task import GraderConfig

if TYPE_CHECKING:  # httpx is imported only where a judge client is made
    import httpx

MIN_SCORE, MAX_SCORE = 0.0, 1.0


@dataclass(frozen=True)
class GradeResult:
    """A reward and why: `details` is JSON-friendly (stored with the grade, shown in audits)."""

    score: float
    details: dict[str, Any] = field(default_factory=dict)


class InvalidGrade(ValueError):
    """A grader produced something that is not a usable reward."""

    def __init__(self, grader: str, value: object, reason: str) -> None:
        self.grader, self.value, self.reason = grader, value, reason
        super().__init__(f"grader {grader!r} produced an invalid grade {value!r}: {reason}")


def validate_grade(grader: str, result: GradeResult) -> GradeResult:
    """`result` with a float score, or InvalidGrade if the score or the details are unusable."""
    score = result.score
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise InvalidGrade(grader, score, "the score is not a number")
    if not math.isfinite(score):
        raise InvalidGrade(grader, score, "the score is not finite")
    if not MIN_SCORE <= score <= MAX_SCORE:
        raise InvalidGrade(grader, score, f"the score is outside [{MIN_SCORE}, {MAX_SCORE}]")
    try:
        json.dumps(result.details, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidGrade(grader, result.details, f"the details are not JSON ({e})") from e
    return GradeResult(float(score), result.details)


@dataclass(frozen=True)
class GraderDeps:
    """What graders may need from the worker that builds them; each grader takes what it uses."""

    executor: Executor | None = None  # the sandbox, for graders that run code
    http_client: "httpx.AsyncClient | None" = None  # shared client for model-based graders


class Grader(ABC):
    """Subclasses set `name` (registry key) and `version` (bump it whenever verdicts may change,
    since cached grades are keyed on it) and implement `score`; `reads_conversation` hands them the
    whole episode instead of the last model message."""

    name: ClassVar[str]
    version: str
    reads_conversation: ClassVar[bool] = False
    """True: `response_text` is the whole episode (graders.conversation), not its last model message."""

    @classmethod
    def from_config(cls, config: GraderConfig, deps: GraderDeps) -> "Grader":
        """Build from the run's grader config; graders with settings or dependencies override this."""
        return cls()

    async def grade(self, task: Task, response_text: str) -> GradeResult:
        """Score the policy's final message for `task`; raises InvalidGrade for an unusable result."""
        return validate_grade(self.name, await self.score(task, response_text))

    @abstractmethod
    async def score(self, task: Task, response_text: str) -> GradeResult:
        """The unvalidated grade; call `grade` instead."""

    async def aclose(self) -> None:
        """Release what the grader opened itself (a judge's own HTTP client)."""
