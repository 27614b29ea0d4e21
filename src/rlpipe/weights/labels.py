"""What an inference server's weight label means, and how a rollout settles unverified spans.

Every response of the generate route names the label of the weights behind each token span
(`POST /update_weight_version` sets it). The sidecar keeps one invariant: a label that is a
plain number is a published version the server verifiably holds. Other labels:

    default                         the weights the server started with (never verified)
    verifying-<v>-<started_us>      version v is loaded and its probe is being checked by the
                                    sync attempt that started at <started_us> (µs since epoch)

A server resumes before its probe is checked (a probe is a request, and a paused server runs
none), so tokens sampled in that window carry the verifying label — in `keep` mode every
request that spans the sync has some. Such a span is neither thrown away nor trusted: the
attempt records its verdict in `sync_events` before it relabels the server, and
`settle_completion` waits for that verdict, then renames the span `v` or rejects the sample.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from rlpipe.inference.client import Completion, WeightSpan
from rlpipe.storage.db import Database
from rlpipe.storage.syncs import attempt_verdict

VERIFYING_PREFIX = "verifying-"
_VERIFYING = re.compile(rf"^{VERIFYING_PREFIX}(\d+)-(\d+)$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)

VerdictLookup = Callable[[int, datetime], Awaitable[str]]
"""(version, attempt started_at) -> "ok" | "rejected" | "pending" (storage.syncs.attempt_verdict)."""


class UnverifiedWeights(RuntimeError):
    """Tokens were sampled from weights whose verification failed or never finished: the sample
    must be thrown away and generated again."""


def published_label(version: int) -> str:
    return str(version)


def verifying_label(version: int, started_at: datetime) -> str:
    """The label of `version` while the attempt that started at `started_at` checks its probe.
    Microseconds, like Postgres timestamps, so the label names exactly one sync_events attempt."""
    return f"{VERIFYING_PREFIX}{version}-{(started_at - _EPOCH) // _MICROSECOND}"


def parse_verifying(label: str) -> tuple[int, datetime] | None:
    """(version, attempt started_at) of a verifying label; None for any other label."""
    match = _VERIFYING.match(label)
    if match is None:
        return None
    return int(match.group(1)), _EPOCH + int(match.group(2)) * _MICROSECOND


def published_version(label: str) -> int | None:
    """The version a plain-number label names; None for every other label."""
    return int(label) if label.isdigit() else None


def verdicts(db: Database, run_id: str, server: str) -> VerdictLookup:
    """The VerdictLookup of one run's syncs on one server, read from `sync_events`."""

    def read(version: int, started_at: datetime) -> str:
        with db.begin() as s:
            return attempt_verdict(s, run_id, version, server, started_at)

    async def lookup(version: int, started_at: datetime) -> str:
        return await asyncio.to_thread(read, version, started_at)

    return lookup


async def settle_completion(completion: Completion, verdict: VerdictLookup, *, timeout_s: float = 120.0,
                            poll_s: float = 0.1) -> Completion:
    """The completion with each verifying span renamed to its version once that attempt's
    verdict is "ok" (adjacent spans of one version merged); raises UnverifiedWeights if it was
    rejected or not given within `timeout_s`. Completions without such spans come back as they are."""
    spans = completion.weight_spans or ()
    attempts = {parsed for span in spans if (parsed := parse_verifying(span.version)) is not None}
    if not attempts:
        return completion
    for version, started_at in sorted(attempts):
        await _await_verified(verdict, version, started_at, timeout_s, poll_s)
    settled = _merged([_renamed(span) for span in spans])
    return dataclasses.replace(completion, weight_spans=settled, weight_version=settled[0].version,
                               last_weight_version=settled[-1].version)


async def _await_verified(verdict: VerdictLookup, version: int, started_at: datetime, timeout_s: float,
                          poll_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (answer := await verdict(version, started_at)) == "pending":
        if time.monotonic() > deadline:
            raise UnverifiedWeights(f"version {version} (sync attempt of {started_at.isoformat()}) got no verdict "
                                    f"within {timeout_s:.0f} s; its tokens are not trusted")
        await asyncio.sleep(poll_s)
    if answer != "ok":
        raise UnverifiedWeights(f"tokens were sampled while version {version} was being verified, and that "
                                f"sync attempt ({started_at.isoformat()}) was {answer}")


def _renamed(span: WeightSpan) -> WeightSpan:
    parsed = parse_verifying(span.version)
    return span if parsed is None else dataclasses.replace(span, version=published_label(parsed[0]))


def _merged(spans: list[WeightSpan]) -> tuple[WeightSpan, ...]:
    out: list[WeightSpan] = []
    for span in spans:
        if out and out[-1].version == span.version and out[-1].end == span.start:
            out[-1] = dataclasses.replace(out[-1], end=span.end)
        else:
            out.append(span)
    return tuple(out)
