"""Every Prometheus metric of the pipeline, in one place, with the port convention of the workers.

RL fails by silent degradation (docs/design.md §1): a full buffer, stale data, an idle trainer or a
grader eating the compute budget never raise an exception. These metrics make each of them a
line on a dashboard. Two kinds of source feed them:

- events, counted where they happen (a finished train step, a sync, a tool call, a failure),
  through the `observe_*` methods of `PipelineMetrics`, and the busy time of each box through
  `BusyTracker`;
- pipeline-wide state that no single process sees (buffer depth, grader share, sync share,
  version lag per server), refreshed from Postgres by `refresh_from_db` in one process.

    METRICS.tracker.declare("grader")            # at worker start: idle boxes report 0, not nothing
    port = serve_metrics(metrics_port("grader"))
    runtime = temporal_runtime(sdk_metrics_port(port))   # Client.connect(..., runtime=runtime)
    with METRICS.tracker.busy("grader"):          # in each activity
        ...

Port convention (`metrics_port`): rollout 9101, sandbox 9102, grader 9103, trainer 9104, the sync
sidecar of inference server i 9110 + i; each process's Temporal SDK metrics on its port + 100.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session

if TYPE_CHECKING:
    from temporalio.runtime import Runtime

# -- ports ------------------------------------------------------------------------------------------
METRICS_BASE_PORT = 9100
WORKER_PORT_OFFSETS = {"rollout": 1, "sandbox": 2, "grader": 3, "trainer": 4}
SIDECAR_PORT_OFFSET = 10
"""Sidecar of inference server i listens on base + 10 + i (room for 90 servers below the SDK ports)."""
SDK_PORT_OFFSET = 100
"""Temporal SDK metrics of a process listen on its own metrics port + 100."""


def metrics_port(kind: str, server: int | None = None, base: int = METRICS_BASE_PORT) -> int:
    """The metrics port of a worker kind ('rollout', 'sandbox', 'grader', 'trainer', or 'sidecar'
    with the inference server's index). `base` moves the whole block, e.g. for a second stack."""
    if kind == "sidecar":
        if server is None or not 0 <= server < SDK_PORT_OFFSET - SIDECAR_PORT_OFFSET:
            raise ValueError(f"a sidecar needs its inference server index (0..89), got {server!r}")
        return base + SIDECAR_PORT_OFFSET + server
    if kind not in WORKER_PORT_OFFSETS:
        raise ValueError(f"unknown worker kind {kind!r}: use one of {', '.join(WORKER_PORT_OFFSETS)} or 'sidecar'")
    return base + WORKER_PORT_OFFSETS[kind]


def sdk_metrics_port(port: int) -> int:
    """Where the Temporal SDK of the process serving `port` exposes its own metrics."""
    return port + SDK_PORT_OFFSET


# -- busy time per box ------------------------------------------------------------------------------
@dataclass
class _BoxState:
    active: int = 0
    """Activities of this box running now."""
    busy_since: float | None = None
    """When `active` last went from 0 to 1 (None while idle)."""
    closed: deque[tuple[float, float]] = field(default_factory=deque)
    """Busy intervals that ended, oldest first; they never overlap (a new one opens only at 0 -> 1)."""
    closed_total_s: float = 0.0
    """Busy seconds of every closed interval since the tracker started (pruning keeps this)."""


class BusyTracker:
    """Which boxes of this process are busy, and for what fraction of the last `window_s` seconds.

    A box is busy while at least one of its activities runs: overlapping activities count once,
    so ten concurrent tool calls for one second are one busy second, not ten. The tracker keeps
    only the transitions idle -> busy -> idle, so its memory is bounded by the window.
    Thread-safe: sync activities run in executor threads.
    """

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 boxes: Iterable[str] = ()) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._boxes: dict[str, _BoxState] = {}
        self.declare(*boxes)

    def declare(self, *boxes: str) -> None:
        """Report these boxes even before their first activity (an idle box shows 0, not a gap)."""
        with self._lock:
            for box in boxes:
                self._boxes.setdefault(box, _BoxState())

    def start(self, box: str) -> None:
        with self._lock:
            state = self._boxes.setdefault(box, _BoxState())
            if state.active == 0:
                state.busy_since = self._clock()
            state.active += 1

    def stop(self, box: str) -> None:
        with self._lock:
            state = self._boxes.get(box)
            if state is None or state.active == 0:
                raise ValueError(f"stop({box!r}) without a matching start")
            state.active -= 1
            if state.active == 0:
                assert state.busy_since is not None
                now = self._clock()
                state.closed.append((state.busy_since, now))
                state.closed_total_s += now - state.busy_since
                state.busy_since = None
                self._prune(state, now)

    @contextmanager
    def busy(self, box: str) -> Iterator[None]:
        """`with tracker.busy("grader"): ...` marks the box busy for the block, even if it raises."""
        self.start(box)
        try:
            yield
        finally:
            self.stop(box)

    def busy_fraction(self, box: str) -> float:
        """Fraction of the last `window_s` seconds (or of the tracker's life, if shorter) during
        which at least one activity of `box` ran."""
        with self._lock:
            now = self._clock()
            since = max(now - self.window_s, self._started)
            span = now - since
            state = self._boxes.get(box)
            if state is None or span <= 0:
                return 1.0 if state is not None and state.active else 0.0
            self._prune(state, now)
            busy = sum(end - max(start, since) for start, end in state.closed if end > since)
            if state.busy_since is not None:
                busy += now - max(state.busy_since, since)
            return min(busy / span, 1.0)

    def busy_seconds_total(self, box: str) -> float:
        """Busy seconds of `box` since the tracker started (a counter: rate() gives the fraction)."""
        with self._lock:
            state = self._boxes.get(box)
            if state is None:
                return 0.0
            running = self._clock() - state.busy_since if state.busy_since is not None else 0.0
            return state.closed_total_s + running

    def active(self, box: str) -> int:
        with self._lock:
            state = self._boxes.get(box)
            return state.active if state else 0

    def boxes(self) -> list[str]:
        with self._lock:
            return sorted(self._boxes)

    def _prune(self, state: _BoxState, now: float) -> None:
        """Forget intervals that ended before the window (caller holds the lock)."""
        while state.closed and state.closed[0][1] <= now - self.window_s:
            state.closed.popleft()


class BusyCollector(Collector):
    """Exposes a BusyTracker at scrape time, so the fraction is always computed for 'now'."""

    def __init__(self, tracker: BusyTracker) -> None:
        self.tracker = tracker

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        window = f"{self.tracker.window_s:g}"
        fraction = GaugeMetricFamily("rlpipe_box_busy_fraction",
                                     "Fraction of the sliding window during which >= 1 activity of the box ran "
                                     "(idle fraction = 1 - this)", labels=["box", "window_s"])
        seconds = CounterMetricFamily("rlpipe_box_busy_seconds",
                                      "Seconds during which >= 1 activity of the box ran (overlaps counted once)",
                                      labels=["box"])
        active = GaugeMetricFamily("rlpipe_box_active_activities", "Activities of the box running now",
                                   labels=["box"])
        for box in self.tracker.boxes():
            fraction.add_metric([box, window], self.tracker.busy_fraction(box))
            seconds.add_metric([box], self.tracker.busy_seconds_total(box))
            active.add_metric([box], self.tracker.active(box))
        yield from (fraction, seconds, active)


# -- the metrics ------------------------------------------------------------------------------------
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
"""Optimiser steps; integers, so `le="1"` counts trajectories at most one step stale."""
SYNC_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
"""Seconds: a tiny model reloads in well under a second, a 135M one in seconds, big ones in minutes."""
STEP_BUCKETS = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
"""Seconds: a 135M step on 2 CPU cores takes ~16 s; GPU steps of big models take minutes."""
LATENCY_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
"""Seconds: tool calls and gradings range from a local regex to a remote sandbox or an LLM judge."""
SYNC_PHASES = ("download", "pause", "reload", "verify", "total")


class PipelineMetrics:
    """The pipeline's metrics on one registry. One instance per process (`METRICS`); tests build
    their own on a fresh registry."""

    def __init__(self, registry: CollectorRegistry | None = None, tracker: BusyTracker | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.tracker = tracker if tracker is not None else BusyTracker()
        self.registry.register(BusyCollector(self.tracker))
        r = self.registry
        # buffer and freshness (refreshed from Postgres: no single worker sees the whole buffer)
        self.buffer_groups = Gauge("rlpipe_buffer_groups", "Completed groups waiting for a train step, still fresh",
                                   ["run"], registry=r)
        self.buffer_trajectories = Gauge("rlpipe_buffer_trajectories",
                                         "Completed trajectories of the fresh waiting groups", ["run"], registry=r)
        self.buffer_stale_groups = Gauge("rlpipe_buffer_stale_groups",
                                         "Waiting groups already too stale for the next step (will be dropped)",
                                         ["run"], registry=r)
        self.staleness = Histogram("rlpipe_staleness_steps",
                                   "Staleness of each consumed trajectory, in optimiser steps", ["run"],
                                   buckets=STALENESS_BUCKETS, registry=r)
        # compute shares (refreshed from Postgres: the boxes live in different processes)
        self.grader_time_share = Gauge("rlpipe_grader_time_share",
                                       "Grader busy seconds / busy seconds of all boxes, over the run", ["run"],
                                       registry=r)
        self.sync_wall_share = Gauge("rlpipe_sync_wall_share",
                                     "Fraction of the run's wall time during which a weight sync ran", ["run"],
                                     registry=r)
        self.sync_paused_share = Gauge("rlpipe_sync_paused_share",
                                       "Fraction of the servers' time paused for weight syncs (no generation)",
                                       ["run"], registry=r)
        # weights
        self.sync_duration = Histogram("rlpipe_sync_duration_seconds", "Weight sync time per phase",
                                       ["run", "server", "phase"], buckets=SYNC_BUCKETS, registry=r)
        self.syncs = Counter("rlpipe_syncs", "Weight syncs by outcome (ok, failed, rolled_back, refused)",
                             ["run", "server", "status"], registry=r)
        self.published_version = Gauge("rlpipe_published_policy_version", "Latest published policy version",
                                       ["run"], registry=r)
        self.server_version = Gauge("rlpipe_server_policy_version", "Policy version the server verifiably holds",
                                    ["run", "server"], registry=r)
        self.server_version_lag = Gauge("rlpipe_server_version_lag",
                                        "Latest published version minus the version the server holds",
                                        ["run", "server"], registry=r)
        # throughput (rates in PromQL)
        self.trajectories = Counter("rlpipe_trajectories", "Finished trajectories by status", ["run", "status"],
                                    registry=r)
        self.groups = Counter("rlpipe_groups", "Finished rollout groups by status", ["run", "status"], registry=r)
        self.generated_tokens = Counter("rlpipe_generated_tokens", "Tokens generated by the policy", ["run"],
                                        registry=r)
        self.trained_tokens = Counter("rlpipe_trained_tokens", "Tokens in committed train steps", ["run"],
                                      registry=r)
        # trainer
        self.train_steps = Counter("rlpipe_train_steps", "Committed optimiser steps", ["run"], registry=r)
        self.train_step_duration = Histogram("rlpipe_train_step_duration_seconds", "Wall time of one train step",
                                             ["run"], buckets=STEP_BUCKETS, registry=r)
        self.train_step = Gauge("rlpipe_train_step", "Last committed optimiser step", ["run"], registry=r)
        self.reward_mean = Gauge("rlpipe_train_reward_mean", "Mean reward of the last step's batch", ["run"],
                                 registry=r)
        self.response_length = Gauge("rlpipe_train_response_length_tokens",
                                     "Mean completion length of the last step's batch", ["run"], registry=r)
        self.entropy = Gauge("rlpipe_train_entropy", "Mean token entropy of the last step (nats)", ["run"],
                             registry=r)
        self.kl_sampler = Gauge("rlpipe_train_kl_sampler", "KL(sampler || trainer) per token of the last step",
                                ["run"], registry=r)
        # rollout side
        self.tool_latency = Histogram("rlpipe_tool_latency_seconds", "Latency of one tool call (sandbox)",
                                      ["tool"], buckets=LATENCY_BUCKETS, registry=r)
        self.grade_latency = Histogram("rlpipe_grade_latency_seconds", "Latency of grading one trajectory",
                                       ["grader", "cache_hit"], buckets=LATENCY_BUCKETS, registry=r)
        # failures
        self.failures = Counter("rlpipe_failures", "Activity failures (retried or final) by box kind",
                                ["kind", "activity"], registry=r)

    # -- events -------------------------------------------------------------------------------------
    def observe_train_step(self, run: str, step: int, duration_s: float, n_tokens: int,
                           staleness: Sequence[int] = (), reward_mean: float | None = None,
                           entropy: float | None = None, kl_sampler: float | None = None,
                           response_length: float | None = None) -> None:
        """After a train step commits: its timing, tokens, the staleness of each trajectory it
        consumed, and the health numbers of its batch."""
        self.train_steps.labels(run).inc()
        self.train_step.labels(run).set(step)
        self.train_step_duration.labels(run).observe(duration_s)
        self.trained_tokens.labels(run).inc(n_tokens)
        for lag in staleness:
            self.staleness.labels(run).observe(lag)
        for gauge, value in ((self.reward_mean, reward_mean), (self.entropy, entropy),
                             (self.kl_sampler, kl_sampler), (self.response_length, response_length)):
            if value is not None:
                gauge.labels(run).set(value)

    def observe_publish(self, run: str, version: int) -> None:
        self.published_version.labels(run).set(version)

    def observe_sync(self, run: str, server: str, version: int, status: str,
                     timings: Mapping[str, float | None]) -> None:
        """After a sync attempt on one server: its outcome and per-phase seconds
        (keys of SYNC_PHASES; None or missing phases are skipped)."""
        self.syncs.labels(run, server, status).inc()
        for phase in SYNC_PHASES:
            seconds = timings.get(phase)
            if seconds is not None:
                self.sync_duration.labels(run, server, phase).observe(seconds)
        if status == "ok":
            self.server_version.labels(run, server).set(version)

    def observe_generation(self, run: str, n_tokens: int) -> None:
        self.generated_tokens.labels(run).inc(n_tokens)

    def observe_group(self, run: str, status: str, trajectory_statuses: Iterable[str]) -> None:
        """When a group closes: the group and each of its trajectories by status."""
        self.groups.labels(run, status).inc()
        for trajectory_status in trajectory_statuses:
            self.trajectories.labels(run, trajectory_status).inc()

    def observe_tool_call(self, tool: str, latency_s: float) -> None:
        self.tool_latency.labels(tool).observe(latency_s)

    def observe_grade(self, grader: str, latency_s: float, cache_hit: bool) -> None:
        self.grade_latency.labels(grader, "true" if cache_hit else "false").observe(latency_s)

    def observe_failure(self, kind: str, activity: str | None) -> None:
        self.failures.labels(kind, activity or "").inc()

    # -- state from Postgres ------------------------------------------------------------------------
    def refresh_from_db(self, s: Session) -> None:
        """Set the pipeline-wide gauges of every running run from Postgres. Run it in ONE process
        (the trainer worker): the values are global, so one exporter is enough."""
        from rlpipe.observe import queries  # SQL only; imported here so metrics alone stays light

        gauges = (self.buffer_groups, self.buffer_trajectories, self.buffer_stale_groups,
                  self.grader_time_share, self.sync_wall_share, self.sync_paused_share, self.server_version_lag)
        for gauge in gauges:
            gauge.clear()  # finished runs disappear instead of freezing at their last value
        for run in queries.running_runs(s):
            buffer = queries.current_buffer(s, run)
            self.buffer_groups.labels(run).set(buffer.fresh_groups)
            self.buffer_trajectories.labels(run).set(buffer.fresh_trajectories)
            self.buffer_stale_groups.labels(run).set(buffer.stale_groups)
            share = queries.grader_time_share(s, run)
            if share is not None:
                self.grader_time_share.labels(run).set(share)
            sync = queries.sync_share(s, run)
            if sync is not None:
                self.sync_wall_share.labels(run).set(sync.share)
                self.sync_paused_share.labels(run).set(sync.paused_share)
            for lag in queries.version_lag(s, run):
                if lag.lag is not None:
                    self.server_version_lag.labels(run, lag.server).set(lag.lag)


METRICS = PipelineMetrics()
"""This process's metrics (one registry per process; `serve_metrics` exposes it)."""


def start_db_refresh(metrics: PipelineMetrics, transaction: Callable[[], AbstractContextManager[Session]],
                     every_s: float = 15.0) -> threading.Event:
    """Refresh the Postgres-derived gauges every `every_s` seconds in a daemon thread, e.g.
    `start_db_refresh(METRICS, db.begin)`. Set the returned event to stop it. A failed refresh
    is logged and retried at the next tick: metrics must never take a worker down."""
    import logging

    log = logging.getLogger("rlpipe.metrics")
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                with transaction() as s:
                    metrics.refresh_from_db(s)
            except Exception:  # noqa: BLE001 - see docstring
                log.warning("refreshing metrics from the database failed", exc_info=True)

    threading.Thread(target=loop, name="rlpipe-metrics-refresh", daemon=True).start()
    return stop


# -- exposition -------------------------------------------------------------------------------------
def serve_metrics(port: int = 0, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None) -> int:
    """Serve `registry` (default: this process's METRICS) at http://addr:port/metrics in a daemon
    thread; port 0 picks a free port. Returns the bound port (the one Prometheus must scrape)."""
    server, _ = start_http_server(port, addr=addr, registry=registry if registry is not None else METRICS.registry)
    return int(server.server_port)


def temporal_runtime(port: int, addr: str = "0.0.0.0", service: str | None = None) -> Runtime:
    """A Temporal `Runtime` whose SDK metrics (task latencies, slots, polls, schedule-to-start)
    are served for Prometheus at addr:port. Build ONE per process, before `Client.connect(...,
    runtime=runtime)`; `service` becomes a `service` label on every SDK metric."""
    from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig  # only workers need temporalio

    tags = {"service": service} if service else {}
    return Runtime(telemetry=TelemetryConfig(
        metrics=PrometheusConfig(bind_address=f"{addr}:{port}", durations_as_seconds=True), global_tags=tags))
