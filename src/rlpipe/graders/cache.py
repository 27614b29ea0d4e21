"""Grade caching: a stable key, the cache interface, and `grade_with_cache`.

The key is sha256 over canonical JSON of (grader name, grader version, the task's gradable content,
the response). The task part is the question, reference and metadata rather than the chat prompt:
graders never see the system prompt, and two tasks that differ only in hidden tests must not share
a grade. Canonical JSON (sorted keys, no spaces, UTF-8, no NaN) makes the key the same in every
process and Python version, so the Postgres-backed cache can be shared by all grader workers.

`InMemoryGradeCache` is a small LRU with the same interface as the Postgres-backed cache; it stores
copies made through JSON, so it behaves like a database column (no aliasing of `details`).
"""

import hashlib
import json
from collections import OrderedDict
from typing import Any, Protocol

from rlpipe.envs.base import Task
from rlpipe.graders.base import Grader, GradeResult


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def grade_cache_key(grader_name: str, grader_version: str, task: Task, response_text: str) -> str:
    """Hex sha256 identifying one grading; equal inputs give equal keys in every process."""
    payload = {
        "grader": grader_name,
        "version": grader_version,
        "prompt": {"question": task.question, "reference": task.reference, "metadata": task.metadata},
        "response": response_text,
    }
    return hashlib.sha256(canonical_json(payload)).hexdigest()


class GradeCache(Protocol):
    """Where finished grades are kept by key (async, so a database-backed cache fits as is)."""

    async def get(self, key: str) -> GradeResult | None: ...

    async def put(self, key: str, result: GradeResult) -> None: ...


def _copy(result: GradeResult) -> GradeResult:
    return GradeResult(result.score, json.loads(json.dumps(result.details)))


class InMemoryGradeCache:
    """Least-recently-used cache of at most `max_entries` grades, local to one process."""

    def __init__(self, max_entries: int = 10_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, GradeResult] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> GradeResult | None:
        result = self._entries.get(key)
        if result is None:
            return None
        self._entries.move_to_end(key)  # most recently used
        return _copy(result)

    async def put(self, key: str, result: GradeResult) -> None:
        self._entries[key] = _copy(result)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)  # least recently used


async def grade_with_cache(
    grader: Grader, cache: GradeCache, task: Task, response_text: str
) -> tuple[GradeResult, bool]:
    """The grade of `response_text` and whether it came from the cache.

    Only validated grades are stored: an InvalidGrade (or any other error) propagates and caches nothing.
    """
    key = grade_cache_key(grader.name, grader.version, task, response_text)
    cached = await cache.get(key)
    if cached is not None:
        return cached, True
    result = await grader.grade(task, response_text)
    await cache.put(key, result)
    return result, False
