"""Which errors mean that a service is unreachable (an outage) rather than that a task failed.

A model call, tool call or grading that fails because the database, the object store or an
inference server cannot be reached would fail the same way on any input: the service is down, not
the task. `instrumented` (activities/common.py) re-raises such an error with the type `OUTAGE`,
and the workflows wait it out for up to the run's outage budget (`rollout.outage_budget_s`), apart
from the attempts a task's own errors get (`workflows.calls.execute_through_outages`).
"""

from __future__ import annotations

import botocore.exceptions
import psycopg
import sqlalchemy.exc

from rlpipe.inference.client import ServerUnavailableError

_UNREACHABLE: tuple[tuple[str, tuple[type[BaseException], ...]], ...] = (
    # the pool's TimeoutError: no connection could be had in time
    ("database", (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, sqlalchemy.exc.TimeoutError,
                  psycopg.OperationalError)),
    ("object store", (botocore.exceptions.ConnectionError,)),  # connect/read failures and timeouts
    ("inference server", (ServerUnavailableError,)),
)


def unreachable_service(exc: BaseException) -> str | None:
    """The kind of service that `exc`, or an error it was raised from, says cannot be reached
    ("database", "object store", "inference server"); None for every other error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for service, types in _UNREACHABLE:
            if isinstance(current, types):
                return service
        current = current.__cause__ or current.__context__
    return None
