"""Orchestration overhead: the same agent loop through Temporal vs a bare asyncio loop (issue #8, item 2).

A fake trajectory is one model call then one tool call, each an `asyncio.sleep` of half the
trajectory's duration (10 ms, 100 ms, 1 s). Temporal drives it the way rlpipe does: one workflow per
trajectory, one activity per call, on the real dev server (a private one, on its own namespace and a
uuid task queue, so no other worker can take the tasks), with the worker in this process. The bare
loop awaits the same two sleeps. Both keep CONCURRENCY trajectories in flight; they alternate repeat
by repeat so the machine's noise hits both.

A third driver runs the same workflows with the SDK's sandbox off (UnsandboxedWorkflowRunner) to
show how much of the overhead is the workflow sandbox (rlpipe's workers keep it on). A fourth runs
them on a second dev server whose SQLite keeps its default settings (rollback journal, an fsync per
commit) instead of the stack's WAL without per-commit fsync (StackSettings.temporal_sqlite_pragmas).

Reported: throughput ratio (Temporal / bare), added latency per trajectory (median Temporal − median
bare), and the highest sustained rate of zero-duration trajectories at high concurrency.

    .venv/bin/python -m benchmarks.orchestration [--repeats 3]
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

from temporalio import activity, workflow

NAME = "orchestration"
CONCURRENCY = 8          # trajectories in flight (rlpipe's default max_concurrent_groups)
DURATIONS = {0.01: 48, 0.1: 48, 1.0: 24}   # trajectory seconds -> trajectories per repeat
SATURATION = (0.0, 160, 64)                 # duration, trajectories, concurrency of the max-rate test
TEMPORAL_DRIVERS = ("temporal", "temporal_unsandboxed", "temporal_sqlite_defaults")


@dataclass
class TrajectoryInput:
    seconds: float


@activity.defn
async def fake_generate(seconds: float) -> int:
    """Stands in for a model call."""
    await asyncio.sleep(seconds)
    return 1


@activity.defn
async def fake_tool(seconds: float) -> int:
    """Stands in for a tool call."""
    await asyncio.sleep(seconds)
    return 1


@workflow.defn
class FakeTrajectoryWorkflow:
    """One trajectory: a model call then a tool call, each an activity (as RolloutGroupWorkflow does)."""

    @workflow.run
    async def run(self, inp: TrajectoryInput) -> int:
        timeout = timedelta(seconds=60)
        a = await workflow.execute_activity(fake_generate, inp.seconds / 2, start_to_close_timeout=timeout)
        b = await workflow.execute_activity(fake_tool, inp.seconds / 2, start_to_close_timeout=timeout)
        return a + b


async def bare_trajectory(seconds: float) -> int:
    """The same loop with no orchestrator."""
    return await fake_generate(seconds / 2) + await fake_tool(seconds / 2)


async def drive(one: Callable[[], Awaitable[int]], n: int, concurrency: int) -> tuple[float, list[float]]:
    """Run n trajectories, at most `concurrency` at once; (wall seconds, per-trajectory latencies)."""
    gate, latencies = asyncio.Semaphore(concurrency), []

    async def timed_one() -> None:
        async with gate:
            t0 = time.perf_counter()
            await one()
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(timed_one() for _ in range(n)))
    return time.perf_counter() - t0, latencies


async def measure(address: str, default_sqlite_address: str, namespace: str, repeats: int) -> dict:  # type: ignore[type-arg]
    from statistics import median

    from temporalio.client import Client
    from temporalio.worker import UnsandboxedWorkflowRunner, Worker

    from benchmarks.common import progress_bar, summarize
    from rlpipe.infra.temporal_client import TemporalConnection, connect_temporal

    client = await connect_temporal(TemporalConnection(address, namespace))
    default_sqlite_client = await connect_temporal(TemporalConnection(default_sqlite_address, namespace))
    queue = f"bench-orchestration-{uuid.uuid4().hex[:8]}"
    plain_queue = f"{queue}-unsandboxed"

    def via(on: Client, task_queue: str) -> Callable[[float], Callable[[], Awaitable[int]]]:
        return lambda seconds: lambda: on.execute_workflow(
            FakeTrajectoryWorkflow.run, TrajectoryInput(seconds), id=f"{task_queue}-{uuid.uuid4().hex}",
            task_queue=task_queue)

    def bare(seconds: float) -> Callable[[], Awaitable[int]]:
        return lambda: bare_trajectory(seconds)

    raw: dict[str, dict[str, list]] = {}  # type: ignore[type-arg]
    drivers = {"bare": bare, "temporal": via(client, queue), "temporal_unsandboxed": via(client, plain_queue),
               "temporal_sqlite_defaults": via(default_sqlite_client, queue)}
    common = {"workflows": [FakeTrajectoryWorkflow], "activities": [fake_generate, fake_tool],
              "max_concurrent_activities": 256}
    async with Worker(client, task_queue=queue, **common), \
            Worker(client, task_queue=plain_queue, workflow_runner=UnsandboxedWorkflowRunner(), **common), \
            Worker(default_sqlite_client, task_queue=queue, **common):
        for warm in TEMPORAL_DRIVERS:   # workflow sandbox, connections
            await drive(drivers[warm](0.0), 16, CONCURRENCY)
        cases = [(d, n, CONCURRENCY) for d, n in DURATIONS.items()] + [SATURATION]
        with progress_bar() as bar:
            task = bar.add_task("orchestration", total=len(cases) * repeats * len(drivers))
            for _ in range(repeats):
                for seconds, n, conc in cases:
                    for kind, make in drivers.items():
                        bar.update(task, description=f"{kind} {seconds * 1000:.0f} ms x{n} @{conc}")
                        wall, lat = await drive(make(seconds), n, conc)
                        entry = raw.setdefault(f"{seconds}|{kind}", {"rate": [], "latency": [], "n": n, "conc": conc})
                        entry["rate"].append(n / wall)
                        entry["latency"].append(median(lat))
                        bar.advance(task)
    table = {}
    for seconds, n, conc in [*((d, n, CONCURRENCY) for d, n in DURATIONS.items()), SATURATION]:
        b = raw[f"{seconds}|bare"]
        table[str(seconds)] = {"trajectories": n, "concurrency": conc, "bare_rate": summarize(b["rate"])}
        for kind in TEMPORAL_DRIVERS:
            t = raw[f"{seconds}|{kind}"]
            table[str(seconds)][kind] = {
                "rate": summarize(t["rate"]),
                "throughput_ratio": summarize([tr / br for tr, br in zip(t["rate"], b["rate"])]),
                "overhead_pct": summarize([100 * (1 - tr / br) for tr, br in zip(t["rate"], b["rate"])]),
                "added_latency_ms": summarize([1000 * (tl - bl) for tl, bl in zip(t["latency"], b["latency"])]),
            }
    return {"cases": table, "raw": raw}


def main() -> None:
    import argparse

    from benchmarks.common import private_stack, write_result
    from tests.conftest import WORKFLOW_LOGIC_NAMESPACE

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with private_stack(only=["temporal"]) as stack, \
            private_stack(only=["temporal"], overrides={"temporal_sqlite_pragmas": []}) as default_sqlite:
        out = asyncio.run(measure(stack.settings.temporal_address, default_sqlite.settings.temporal_address,
                                  WORKFLOW_LOGIC_NAMESPACE, args.repeats))
    print(write_result(NAME, {"params": {"concurrency": CONCURRENCY, "repeats": args.repeats,
                                         "calls_per_trajectory": 2}, **out}))


if __name__ == "__main__":
    main()
