"""The SQL behind the report, the doctor and the Postgres-derived gauges: one run's data as plain
dataclasses. No plotting and no judgement here, so every number a plot or a verdict shows can be
traced to one query (docs/sql.md has the same queries to paste into psql).

Time is kept as it is stored (timestamptz); `RunWindow` turns it into seconds since the run's
first recorded event, which is what plots and shares use.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

import sqlalchemy as sa
from sqlalchemy.orm import Session

from rlpipe.schemas.config import RunConfig

TextRow: TypeAlias = sa.Row[*tuple[Any, ...]]
"""A row of a text query: any number of columns, of types known only to the SQL."""


def _rows(s: Session, sql: str, run: str, **params: Any) -> Sequence[TextRow]:
    return s.execute(sa.text(sql), {"run": run, **params}).all()


# -- the run ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunInfo:
    run_id: str
    mode: str
    status: str
    max_staleness: int
    """With the mode's default applied (1 async, 0 sync)."""
    sync_interval: int
    groups_per_step: int
    group_size: int
    steps: int
    """Steps the config asks for."""


DEFAULTS = RunConfig()


def run_info(s: Session, run_id: str) -> RunInfo:
    """The run and the few config values the checks need. Read from the stored JSON field by field
    (defaults from RunConfig): a stored config of an older schema must still be diagnosable."""
    row = _rows(s, "select mode, status, config from runs where id = :run", run=run_id)
    if not row:
        raise LookupError(f"no run named {run_id!r}")
    mode, status, config = row[0]
    sync, rollout = config.get("sync") or {}, config.get("rollout") or {}
    staleness = RunConfig.model_construct(mode=mode, max_staleness=config.get("max_staleness")).staleness
    return RunInfo(run_id, mode, status, staleness,
                   sync_interval=int(sync.get("interval", DEFAULTS.sync.interval)),
                   groups_per_step=int(rollout.get("groups_per_step", DEFAULTS.rollout.groups_per_step)),
                   group_size=int(rollout.get("group_size", DEFAULTS.rollout.group_size)),
                   steps=int(config.get("steps", DEFAULTS.steps)))


def running_runs(s: Session) -> list[str]:
    return list(s.scalars(sa.text("select id from runs where status in ('running', 'paused') order by id")))


@dataclass(frozen=True)
class RunWindow:
    """First and last recorded event of the run (groups, steps, activity spans, syncs)."""

    start: datetime | None
    end: datetime | None

    @property
    def wall_s(self) -> float:
        return (self.end - self.start).total_seconds() if self.start and self.end else 0.0

    def offset(self, at: datetime) -> float:
        """Seconds from the run's start to `at`."""
        assert self.start is not None
        return (at - self.start).total_seconds()


def run_window(s: Session, run_id: str) -> RunWindow:
    row = _rows(s, """
        select min(t0), max(t1) from (
            select started_at as t0, coalesce(completed_at, started_at) as t1 from rollout_groups where run_id = :run
            union all select started_at, finished_at from train_steps where run_id = :run
            union all select started_at, finished_at from activity_spans where run_id = :run
            union all select started_at, finished_at from sync_events where run_id = :run
        ) events""", run=run_id)[0]
    return RunWindow(row[0], row[1])


# -- train steps ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepRow:
    step: int
    policy_version: int
    published_version: int | None
    n_groups: int
    n_trajectories: int
    n_tokens: int
    loss: float | None
    reward_mean: float | None
    reward_std: float | None
    response_length_mean: float | None
    entropy: float | None
    kl_sampler: float | None
    grad_norm: float | None
    staleness_mean: float | None
    staleness_max: int | None
    started_at: datetime
    finished_at: datetime
    metrics: dict[str, Any]

    @property
    def duration_s(self) -> float:
        return (self.finished_at - self.started_at).total_seconds()


def step_metrics(s: Session, run_id: str) -> list[StepRow]:
    """Every committed step's row, in step order."""
    rows = _rows(s, """
        select step, policy_version, published_version, n_groups, n_trajectories, n_tokens, loss, reward_mean,
               reward_std, response_length_mean, entropy, kl_sampler, grad_norm, staleness_mean, staleness_max,
               started_at, finished_at, coalesce(metrics, '{}'::jsonb)
        from train_steps where run_id = :run order by step""", run=run_id)
    return [StepRow(*row) for row in rows]


@dataclass(frozen=True)
class RewardDistribution:
    """Rewards of the trajectories one step trained on."""

    step: int
    n: int
    mean: float
    p10: float
    p25: float
    p50: float
    p75: float
    p90: float


def reward_distribution(s: Session, run_id: str) -> list[RewardDistribution]:
    rows = _rows(s, """
        select g.claimed_step, count(*), avg(t.reward),
               percentile_cont(array[0.1, 0.25, 0.5, 0.75, 0.9]) within group (order by t.reward)
        from trajectories t join rollout_groups g on g.id = t.group_id
        where t.run_id = :run and g.claimed_step is not null and t.status = 'completed' and t.reward is not null
        group by g.claimed_step order by g.claimed_step""", run=run_id)
    return [RewardDistribution(step, n, float(mean), *map(float, q)) for step, n, mean, q in rows]


@dataclass(frozen=True)
class VersionReward:
    version: int
    n: int
    mean: float
    std: float


def reward_by_version(s: Session, run_id: str) -> list[VersionReward]:
    """Mean reward of completed trajectories by the (oldest) version that generated them: does the
    policy get better, independent of when the trainer consumed its data?"""
    rows = _rows(s, """
        select policy_version, count(*), avg(reward), coalesce(stddev_pop(reward), 0)
        from trajectories
        where run_id = :run and status = 'completed' and reward is not null and policy_version is not null
        group by policy_version order by policy_version""", run=run_id)
    return [VersionReward(v, n, float(m), float(sd)) for v, n, m, sd in rows]


# -- groups, staleness, buffer ----------------------------------------------------------------------
@dataclass(frozen=True)
class GroupCounts:
    running: int
    completed: int
    consumed: int
    dropped: int
    failed: int
    zero_std_consumed: int
    """Consumed groups whose samples all got the same reward: their GRPO advantages are all zero."""
    uninformative_dropped: int
    """Groups that dynamic sampling dropped for the same reason (rollout.dynamic_sampling)."""


def group_counts(s: Session, run_id: str) -> GroupCounts:
    row = _rows(s, """
        select count(*) filter (where status = 'running'),
               count(*) filter (where status = 'completed'),
               count(*) filter (where claimed_step is not null),
               count(*) filter (where status = 'dropped'),
               count(*) filter (where status = 'failed'),
               count(*) filter (where claimed_step is not null and coalesce(reward_std, 0) < 1e-9),
               count(*) filter (where status = 'dropped' and status_reason like 'uninformative%')
        from rollout_groups where run_id = :run""", run=run_id)[0]
    return GroupCounts(*row)


def staleness_histogram(s: Session, run_id: str) -> dict[int, int]:
    """Consumed trajectories by staleness in optimiser steps (v_version_lag)."""
    rows = _rows(s, "select staleness, count(*) from v_version_lag where run_id = :run "
                    "group by staleness order by staleness", run=run_id)
    return {int(lag): n for lag, n in rows}


@dataclass(frozen=True)
class StepStaleness:
    step: int
    mean: float
    std: float
    max: int
    n: int
    """Trajectories the step consumed."""
    bound: int
    """The max_staleness the step claimed under (train_steps.max_staleness; a schedule update can
    change it mid-run), or the run's configured one where the step recorded none."""
    at_bound: int
    """Trajectories at least `bound` steps stale."""
    over_bound: int
    """Trajectories more than `bound` steps stale: the freshness rule slipped."""


def staleness_by_step(s: Session, run_id: str, default_bound: int) -> list[StepStaleness]:
    """Staleness of each step's data next to the step's own bound; `default_bound` (the run's
    configured max_staleness, RunInfo) stands in for steps that recorded none."""
    rows = _rows(s, """
        select step, avg(staleness), coalesce(stddev_pop(staleness), 0), max(staleness), count(*),
               coalesce(max(max_staleness), :default_bound),
               count(*) filter (where staleness >= coalesce(max_staleness, :default_bound)),
               count(*) filter (where staleness > coalesce(max_staleness, :default_bound))
        from v_version_lag where run_id = :run group by step order by step""", run=run_id, default_bound=default_bound)
    return [StepStaleness(step, float(m), float(sd), mx, n, bound, at, over)
            for step, m, sd, mx, n, bound, at, over in rows]


def describe_bounds(steps: Sequence[StepStaleness]) -> str:
    """The staleness bounds in force, for messages: '2' when every step had bound 2, else each
    bound with its steps, e.g. '2 (steps 1-4), 3 (steps 5-10)'."""
    spans: list[list[int]] = []  # [bound, first step, last step]
    for x in steps:
        if spans and spans[-1][0] == x.bound:
            spans[-1][2] = x.step
        else:
            spans.append([x.bound, x.step, x.step])
    if len({bound for bound, _, _ in spans}) <= 1:
        return str(spans[0][0]) if spans else ""
    return ", ".join(f"{bound} (step {first})" if first == last else f"{bound} (steps {first}-{last})"
                     for bound, first, last in spans)


@dataclass(frozen=True)
class DepthPoint:
    at: datetime
    groups: int
    """Groups in the buffer from `at` until the next point."""


BUFFER_DEPTH_SQL = """
    -- a group enters the buffer when it completes and leaves when dropped (consumed_at) or claimed:
    -- a step claims its batch when it starts, so a claimed group leaves at the earlier of its
    -- consumed_at and its step's started_at (LEAST ignores NULLs)
    with g as (
        select g.completed_at as entered, least(g.consumed_at, st.started_at) as left_at
        from rollout_groups g
        left join train_steps st on st.run_id = g.run_id and st.step = g.claimed_step
        where g.run_id = :run and g.status in ('completed', 'dropped') and g.completed_at is not null
    ), events as (
        select entered as at, 1 as delta from g
        union all select left_at, -1 from g where left_at is not null
    )
    select at, sum(sum(delta)) over (order by at) as depth from events group by at order by at"""


def buffer_depth(s: Session, run_id: str) -> list[DepthPoint]:
    """The buffer's depth (groups) as a step function: one point per change."""
    return [DepthPoint(at, int(depth)) for at, depth in _rows(s, BUFFER_DEPTH_SQL, run=run_id)]


def depth_before(points: Sequence[DepthPoint], at: datetime) -> int:
    """Depth just before `at` (so a step's own claim at `at` is not yet subtracted)."""
    i = bisect_left([p.at for p in points], at)
    return points[i - 1].groups if i > 0 else 0


@dataclass(frozen=True)
class StepWait:
    """How long the groups a step trained on sat in the buffer."""

    step: int
    mean_steps: float
    """Optimiser steps that finished between a group's completion and its claim, averaged: the
    part of staleness caused by waiting in the buffer (rollouts ahead of the trainer)."""
    max_steps: int
    mean_s: float


def buffer_waits(s: Session, run_id: str) -> list[StepWait]:
    """Per step, the buffer wait of its groups. Unlike the depth, this does not drain at the end
    of a run (when no more groups are started), so its trend is comparable across the run."""
    rows = _rows(s, """
        select g.claimed_step, avg(w.steps), max(w.steps),
               avg(extract(epoch from st.started_at - g.completed_at))::float8
        from rollout_groups g
        join train_steps st on st.run_id = g.run_id and st.step = g.claimed_step
        cross join lateral (
            select count(*) as steps from train_steps f
            where f.run_id = g.run_id and f.finished_at > g.completed_at and f.finished_at <= st.started_at
        ) w
        where g.run_id = :run and g.claimed_step is not null
        group by g.claimed_step order by g.claimed_step""", run=run_id)
    return [StepWait(step, float(m), int(mx), float(sec)) for step, m, mx, sec in rows]


@dataclass(frozen=True)
class BufferNow:
    fresh_groups: int
    fresh_trajectories: int
    stale_groups: int
    """Waiting groups the next step's freshness rule will drop."""


def current_buffer(s: Session, run_id: str) -> BufferNow:
    """Completed, unclaimed groups now, split by the freshness rule of the next step
    (generated by weights with >= last step - max_staleness optimiser steps)."""
    bound = run_info(s, run_id).max_staleness
    row = _rows(s, """
        with last as (select coalesce(max(step), 0) as step from train_steps where run_id = :run),
        waiting as (
            select g.n_completed, coalesce(pv.trained_steps >= (select step from last) - :bound, true) as fresh
            from rollout_groups g
            left join policy_versions pv on pv.run_id = g.run_id and pv.version = g.min_version
            where g.run_id = :run and g.status = 'completed' and g.claimed_step is null
        )
        select count(*) filter (where fresh), coalesce(sum(n_completed) filter (where fresh), 0),
               count(*) filter (where not fresh)
        from waiting""", run=run_id, bound=bound)[0]
    return BufferNow(*map(int, row))


# -- busy and idle time per box ---------------------------------------------------------------------
ISLANDS_SQL = """
    -- merge overlapping intervals per lane ("gaps and islands"): an interval starts a new island
    -- when it begins after every earlier interval of its lane has ended
    with spans as ({source}),
    marked as (
        select lane, t0, t1, id,
               case when t0 <= max(t1) over (partition by lane order by t0, t1, id
                                             rows between unbounded preceding and 1 preceding)
                    then 0 else 1 end as new_island
        from spans
    ), numbered as (
        select lane, t0, t1,
               sum(new_island) over (partition by lane order by t0, t1, id rows unbounded preceding) as island
        from marked
    )
    select lane, min(t0), max(t1), count(*) from numbered group by lane, island order by lane, min(t0)"""

SPAN_SOURCE = "select box as lane, started_at as t0, finished_at as t1, id from activity_spans where run_id = :run"
SYNC_SOURCE = "select 'sync' as lane, started_at as t0, finished_at as t1, id from sync_events where run_id = :run"


@dataclass(frozen=True)
class Segment:
    """A stretch of time during which at least one activity of `box` ran."""

    box: str
    start: datetime
    end: datetime
    n_activities: int

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


def timeline(s: Session, run_id: str) -> list[Segment]:
    """Busy segments per box (overlapping activity spans merged), by box then time."""
    return [Segment(*row) for row in _rows(s, ISLANDS_SQL.format(source=SPAN_SOURCE), run=run_id)]


@dataclass(frozen=True)
class BoxUsage:
    box: str
    busy_s: float
    wall_s: float
    n_activities: int

    @property
    def busy_fraction(self) -> float:
        return min(self.busy_s / self.wall_s, 1.0) if self.wall_s > 0 else 0.0

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_fraction


def box_usage(s: Session, run_id: str) -> dict[str, BoxUsage]:
    """Busy seconds per box over the run's wall time (overlaps counted once)."""
    wall = run_window(s, run_id).wall_s
    usage: dict[str, BoxUsage] = {}
    for seg in timeline(s, run_id):
        prev = usage.get(seg.box, BoxUsage(seg.box, 0.0, wall, 0))
        usage[seg.box] = BoxUsage(seg.box, prev.busy_s + seg.seconds, wall, prev.n_activities + seg.n_activities)
    return usage


def trainer_duty(s: Session, run_id: str) -> float | None:
    """Share of the trainer's steady window (first step's start to last step's end) spent inside
    successful train_step attempts; None before two steps. The window leaves out the start-up
    (policy init, the first rollouts), so it says whether the trainer runs steps back to back."""
    row = _rows(s, """
        select sum(extract(epoch from finished_at - started_at)),
               extract(epoch from max(finished_at) - min(started_at)), count(*)
        from activity_spans where run_id = :run and activity = 'train_step' and ok""", run=run_id)[0]
    busy, window, n = row
    return min(float(busy) / float(window), 1.0) if n >= 2 and window else None


def grader_time_share(s: Session, run_id: str) -> float | None:
    """Grader busy seconds / busy seconds of all boxes; None without activity spans."""
    usage = box_usage(s, run_id)
    total = sum(u.busy_s for u in usage.values())
    if total <= 0:
        return None
    grader = usage.get("grader")
    return grader.busy_s / total if grader else 0.0


@dataclass(frozen=True)
class SyncShare:
    sync_s: float
    """Seconds during which at least one server was syncing (download, pause, reload, verify)."""
    wall_s: float
    n_syncs: int
    paused_server_s: float
    """Seconds servers spent paused for syncs, summed over servers: the generation time lost.
    Downloads and verification run while the server still serves."""
    n_servers: int

    @property
    def share(self) -> float:
        return min(self.sync_s / self.wall_s, 1.0) if self.wall_s > 0 else 0.0

    @property
    def paused_share(self) -> float:
        """Share of the servers' wall time during which they could not generate."""
        capacity = self.wall_s * max(self.n_servers, 1)
        return min(self.paused_server_s / capacity, 1.0) if capacity > 0 else 0.0


def sync_share(s: Session, run_id: str) -> SyncShare | None:
    """Share of the run's wall time spent in weight syncs (any server); None without syncs."""
    islands = _rows(s, ISLANDS_SQL.format(source=SYNC_SOURCE), run=run_id)
    if not islands:
        return None
    seconds = sum((t1 - t0).total_seconds() for _, t0, t1, _ in islands)
    [(paused, servers)] = _rows(
        s, "select coalesce(sum(pause_s), 0), count(distinct server) from sync_events where run_id = :run", run=run_id)
    return SyncShare(seconds, run_window(s, run_id).wall_s, sum(n for *_, n in islands), float(paused), servers)


# -- weight syncs and versions ----------------------------------------------------------------------
@dataclass(frozen=True)
class SyncRow:
    version: int
    server: str
    status: str
    bytes: int
    attempts: int
    download_s: float | None
    pause_s: float | None
    reload_s: float | None
    verify_s: float | None
    total_s: float | None
    probe_max_abs_diff: float | None
    probe_tolerance: float | None
    """The bound the verification held probe_max_abs_diff to (weights/tolerance.py)."""
    error: str | None
    started_at: datetime
    finished_at: datetime


def sync_timings(s: Session, run_id: str) -> list[SyncRow]:
    """Every sync event, in the order they started."""
    rows = _rows(s, """
        select version, server, status, bytes, attempts, download_s, pause_s, reload_s, verify_s, total_s,
               probe_max_abs_diff, probe_tolerance, error, started_at, finished_at
        from sync_events where run_id = :run order by started_at, server""", run=run_id)
    return [SyncRow(*row) for row in rows]


@dataclass(frozen=True)
class ServerLag:
    server: str
    synced_version: int | None
    """Newest version the server loaded and verified (None: never synced, it serves version 0)."""
    latest_version: int

    @property
    def lag(self) -> int:
        return self.latest_version - (self.synced_version or 0)


def version_lag(s: Session, run_id: str) -> list[ServerLag]:
    """How many published versions each inference server is behind."""
    rows = _rows(s, """
        select e.server, max(e.version) filter (where e.status = 'ok'),
               (select coalesce(max(version), 0) from policy_versions where run_id = :run)
        from sync_events e where e.run_id = :run group by e.server order by e.server""", run=run_id)
    return [ServerLag(server, synced, latest) for server, synced, latest in rows]


@dataclass(frozen=True)
class VersionAnomalies:
    latest_published: int | None
    turns_version_backwards: int
    """Turns whose server reported an older version after the call than before it."""
    trajectories_unpublished_version: int
    """Trajectories that claim a version that was never published."""


def version_anomalies(s: Session, run_id: str) -> VersionAnomalies:
    row = _rows(s, """
        select (select max(version) from policy_versions where run_id = :run),
               (select count(*) from turns tu join trajectories t on t.id = tu.trajectory_id
                where t.run_id = :run and tu.version_after < tu.version_before),
               (select count(*) from trajectories t where t.run_id = :run and t.policy_version is not null
                and not exists (select 1 from policy_versions p where p.run_id = t.run_id
                                and p.version = t.policy_version))""", run=run_id)[0]
    return VersionAnomalies(*row)


# -- rollout side: tools and graders ----------------------------------------------------------------
TOOL_CALLS_SQL = """
    select tu.trajectory_id, tu.turn_index, c.ordinality - 1 as call_index, c.value ->> 'name' as tool,
           (c.value -> 'result' ->> 'latency_s')::float8 as latency_s, c.value -> 'result' ->> 'status' as status,
           left(c.value -> 'result' ->> 'reason', 200) as reason, tu.server
    from turns tu
    join trajectories t on t.id = tu.trajectory_id
    cross join lateral jsonb_array_elements(
        case when jsonb_typeof(tu.tool_calls) = 'array' then tu.tool_calls else '[]'::jsonb end
    ) with ordinality as c(value, ordinality)
    where t.run_id = :run and c.value -> 'result' ->> 'latency_s' is not null"""


@dataclass(frozen=True)
class ToolCallRow:
    trajectory_id: int
    turn_index: int
    call_index: int
    tool: str | None
    latency_s: float
    status: str | None
    reason: str | None
    server: str | None


def slowest_tool_calls(s: Session, run_id: str, limit: int = 10) -> list[ToolCallRow]:
    rows = _rows(s, TOOL_CALLS_SQL + " order by latency_s desc limit :limit", run=run_id, limit=limit)
    return [ToolCallRow(*row) for row in rows]


@dataclass(frozen=True)
class LatencyStats:
    n: int
    p50: float
    p90: float
    p99: float
    max: float
    total_s: float


def _latency_stats(row: Sequence[Any]) -> LatencyStats | None:
    n, percentiles, longest, total = row
    if not n:
        return None
    p50, p90, p99 = map(float, percentiles)
    return LatencyStats(n, p50, p90, p99, float(longest), float(total))


def tool_latency_stats(s: Session, run_id: str) -> LatencyStats | None:
    """Percentiles of every tool call's latency (None without tool calls)."""
    row = _rows(s, f"""
        select count(*), percentile_cont(array[0.5, 0.9, 0.99]) within group (order by latency_s),
               max(latency_s), sum(latency_s)
        from ({TOOL_CALLS_SQL}) calls""", run=run_id)[0]
    return _latency_stats(row)


def tool_share_of_group_time(s: Session, run_id: str) -> float | None:
    """Share of the groups' wall time spent waiting on tools. A group ends with its slowest sample,
    so each group counts the tool seconds of its most tool-bound sample (capped at its duration)."""
    row = _rows(s, """
        with sample_tools as (
            select t.group_id, sum(coalesce(tu.tool_latency_s, 0)) as tool_s
            from trajectories t join turns tu on tu.trajectory_id = t.id
            where t.run_id = :run group by t.group_id, t.id
        ), per_group as (
            select extract(epoch from g.completed_at - g.started_at)::float8 as group_s, max(st.tool_s) as tool_s
            from rollout_groups g join sample_tools st on st.group_id = g.id
            where g.run_id = :run and g.completed_at is not null group by g.id, g.completed_at, g.started_at
        )
        select sum(least(tool_s, group_s)) / nullif(sum(group_s), 0) from per_group""", run=run_id)[0]
    return float(row[0]) if row[0] is not None else None


@dataclass(frozen=True)
class GradeStats:
    latency: LatencyStats
    cache_hit_rate: float


def grade_stats(s: Session, run_id: str) -> GradeStats | None:
    row = _rows(s, """
        select count(*), percentile_cont(array[0.5, 0.9, 0.99]) within group (order by gr.latency_s),
               max(gr.latency_s), sum(gr.latency_s), avg(gr.cache_hit::int)
        from grades gr join trajectories t on t.id = gr.trajectory_id where t.run_id = :run""", run=run_id)[0]
    latency = _latency_stats(row[:4])
    return GradeStats(latency, float(row[4])) if latency else None


# -- failures ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FailureCount:
    kind: str
    activity: str | None
    error_type: str
    failures: int
    first_at: datetime
    last_at: datetime
    last_message: str


def failures_by_kind(s: Session, run_id: str) -> list[FailureCount]:
    rows = _rows(s, "select kind, activity, error_type, failures, first_at, last_at, last_message "
                    "from v_failures where run_id = :run order by failures desc, kind", run=run_id)
    return [FailureCount(*row) for row in rows]


@dataclass(frozen=True)
class AttemptCounts:
    box: str
    attempts: int
    failed: int


def attempts_by_box(s: Session, run_id: str) -> list[AttemptCounts]:
    """Activity attempts per box and how many failed (activity_spans.ok = false)."""
    rows = _rows(s, "select box, count(*), count(*) filter (where not ok) from activity_spans "
                    "where run_id = :run group by box order by box", run=run_id)
    return [AttemptCounts(*row) for row in rows]


# -- evals and lineage ------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvalRow:
    version: int
    split: str
    n_prompts: int
    accuracy: float
    mean_reward: float | None


def eval_accuracy(s: Session, run_id: str) -> list[EvalRow]:
    rows = _rows(s, "select version, split, n_prompts, accuracy, mean_reward from eval_results "
                    "where run_id = :run order by split, version", run=run_id)
    return [EvalRow(*row) for row in rows]


@dataclass(frozen=True)
class Lineage:
    """What went into one checkpoint: the steps folded into it since the previous version, the
    groups and trajectories those steps trained on, and which versions generated them."""

    version: int
    trained_steps: int
    checkpoint_key: str
    sha256: str
    steps: list[int]
    n_groups: int
    n_trajectories: int
    generated_by: dict[int, int]
    """Generating version -> trajectories."""
    reward_mean: float | None


def checkpoint_lineage(s: Session, run_id: str, version: int) -> Lineage:
    head = _rows(s, """
        select p.trained_steps, p.checkpoint_key, p.sha256,
               coalesce((select q.trained_steps from policy_versions q
                         where q.run_id = p.run_id and q.version = p.version - 1), 0)
        from policy_versions p where p.run_id = :run and p.version = :version""", run=run_id, version=version)
    if not head:
        raise LookupError(f"run {run_id!r} has no policy version {version}")
    trained, key, sha, previous = head[0]
    steps = [row[0] for row in _rows(s, "select step from train_steps where run_id = :run and step > :lo "
                                        "and step <= :hi order by step", run=run_id, lo=previous, hi=trained)]
    consumed = "from v_trajectory_lineage where run_id = :run and produced_version = :version and status = 'completed'"
    n_groups, n_trajectories, reward_mean = _rows(
        s, f"select count(distinct group_index), count(*), avg(reward) {consumed}", run=run_id, version=version)[0]
    generated_by = _rows(s, f"select generated_by_version, count(*) {consumed} group by 1 order by 1",
                         run=run_id, version=version)
    return Lineage(version, trained, key, sha, steps, n_groups, n_trajectories,
                   generated_by={v: n for v, n in generated_by},
                   reward_mean=float(reward_mean) if reward_mean is not None else None)
