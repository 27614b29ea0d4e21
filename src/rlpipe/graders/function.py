"""A user's reward function as a grader: `fn(task, response_text)` returning a float in [0, 1] or a
`GradeResult`, plain or async, named by import path (`grader.name = "my_pkg.rewards:exact"`) or by an
entry point in group `rlpipe.graders`.

>>> from rlpipe.envs.base import Task
>>> def exact(task: Task, response_text: str) -> float:
...     return float(response_text.strip().lower() == task.reference.lower())
>>> grader = function_grader("my_pkg.rewards:exact", exact)()
>>> import asyncio
>>> asyncio.run(grader.grade(Task("t", "train", 0, "Capital of France?", "Paris"), " paris ")).score
1.0

The grader's version is a hash of the function's source, so editing the function invalidates the
grades cached for it (grader_cache is keyed on name and version) instead of serving stale verdicts.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
from collections.abc import Callable
from typing import Any

from rlpipe.envs.base import Task
from rlpipe.graders.base import Grader, GradeResult


def source_version(fn: Callable[..., Any]) -> str:
    """sha256 of `fn`'s source, or of its qualified name where the source is not on disk."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        source = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    return hashlib.sha256(source.encode()).hexdigest()[:12]


def function_grader(name: str, fn: Callable[..., Any]) -> type[Grader]:
    """A Grader class named `name` whose score is `fn(task, response_text)`."""
    is_async = inspect.iscoroutinefunction(fn)

    class FunctionGrader(Grader):
        __doc__ = f"The reward function {name}."
        version = source_version(fn)

        async def score(self, task: Task, response_text: str) -> GradeResult:
            # a plain function runs in a thread: a slow one must not stall the grader worker's event loop
            result = await fn(task, response_text) if is_async else await asyncio.to_thread(fn, task, response_text)
            return result if isinstance(result, GradeResult) else GradeResult(result)

    FunctionGrader.name = name
    FunctionGrader.__qualname__ = f"FunctionGrader[{name}]"
    return FunctionGrader
