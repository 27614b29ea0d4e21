"""Timeouts and retry policies per kind of activity, chosen once so that every call site is short.

Generation and tools are retried with backoff (servers restart, sandboxes are flaky); a grader
raising `InvalidGrade` is not retried (grading again gives the same answer); trainer and sync
calls heartbeat so a killed worker is noticed within seconds, not at the start-to-close limit.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TypedDict

from temporalio.common import RetryPolicy

# Error types that the same input raises again on every try. Temporal matches the raised class's own
# name, not its bases, so each subclass of InvalidGrade is named (a unit test keeps the list whole).
NON_RETRYABLE = ["InvalidGrade", "UnparsableJudgeOutput", "JudgeRequestRefused", "ConfigError", "ContextTooLong",
                 "DigestMismatch", "DuplicateRunName"]

OUTAGE = "ServiceOutage"
"""The error type of an activity that failed because a service (database, object store, inference
server) was unreachable (activities/outages.py). Bookkeeping retries it like any error, forever; a
task call (model, tool, grading) leaves it to the workflow, which waits the outage out for up to
the run's outage budget without spending the task's own attempts (`calls.execute_through_outages`)."""


class ActivityOptions(TypedDict, total=False):
    """The options of `workflow.execute_activity` that this module chooses (timeouts, retries)."""

    schedule_to_close_timeout: timedelta
    start_to_close_timeout: timedelta
    heartbeat_timeout: timedelta
    retry_policy: RetryPolicy


def retry(attempts: int, first_s: float = 1.0, max_s: float = 30.0, *,
          outages_to_workflow: bool = False) -> RetryPolicy:
    """`attempts` tries (0 = unlimited) with exponential backoff from `first_s` to `max_s`;
    `outages_to_workflow`: an outage is not retried here but handed to the calling workflow."""
    return RetryPolicy(initial_interval=timedelta(seconds=first_s), backoff_coefficient=2.0,
                       maximum_interval=timedelta(seconds=max_s), maximum_attempts=attempts,
                       non_retryable_error_types=NON_RETRYABLE + [OUTAGE] if outages_to_workflow else NON_RETRYABLE)


BOOKKEEPING: ActivityOptions = {"start_to_close_timeout": timedelta(seconds=20), "retry_policy": retry(0, max_s=10)}
"""Database writes on the workflow queue: retried until the database is back. Each takes well under
a second; the limit is how long one lost with a killed worker holds up its group before it is retried."""

TRAIN: ActivityOptions = {"start_to_close_timeout": timedelta(hours=2), "heartbeat_timeout": timedelta(seconds=30),
                          "retry_policy": retry(0, first_s=2, max_s=30)}
"""A train step may take long; it heartbeats, and a killed trainer's step is retried on a new one."""


EVALUATE: ActivityOptions = {"start_to_close_timeout": timedelta(minutes=30),
                             "heartbeat_timeout": timedelta(seconds=60),
                             "retry_policy": retry(3, first_s=2, outages_to_workflow=True)}
"""A held-out evaluation: a few hundred greedy episodes through one server."""


def sync_options(timeout_s: float) -> ActivityOptions:
    """Retried until `timeout_s` has passed in all, not for a count of attempts: a failed attempt
    usually means the server is restarting, and a vLLM start takes 40-150 s on 2 cores, longer than
    5 quick attempts last (~30 s). A base-policy sync that gives up fails the whole run, and a later
    one leaves the server on old weights (chaos runs found both)."""
    limit = timedelta(seconds=timeout_s)
    return {"schedule_to_close_timeout": limit, "start_to_close_timeout": limit,
            "heartbeat_timeout": timedelta(seconds=60), "retry_policy": retry(0, first_s=2, max_s=30)}


GENERATE_HEARTBEAT = timedelta(seconds=15)
"""Three of the generate activity's heartbeats (every 5 s): a killed rollout worker's turns are
retried elsewhere 15 s later, while groups wait on them."""


def generate_options(timeout_s: float, attempts: int) -> ActivityOptions:
    return {"start_to_close_timeout": timedelta(seconds=timeout_s), "heartbeat_timeout": GENERATE_HEARTBEAT,
            "retry_policy": retry(attempts, outages_to_workflow=True)}


def tool_options(timeout_s: float, attempts: int) -> ActivityOptions:
    return {"start_to_close_timeout": timedelta(seconds=timeout_s),
            "retry_policy": retry(attempts, outages_to_workflow=True)}


def grade_options(timeout_s: float, attempts: int) -> ActivityOptions:
    return {"start_to_close_timeout": timedelta(seconds=timeout_s), "heartbeat_timeout": timedelta(seconds=60),
            "retry_policy": retry(attempts, outages_to_workflow=True)}
