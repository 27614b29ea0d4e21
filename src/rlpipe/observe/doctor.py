"""`diagnose(session, run_id)`: walk the triage order over one run's data in Postgres and say, for
each check, whether it is ok, worth a look (warn) or the problem (problem), with the numbers,
one sentence of verdict and the config change that fixes it.

RL pipelines degrade silently (docs/design.md §1): a starved trainer, a grader eating the compute, data
sitting at the staleness bound or a collapsing entropy all still produce finite losses. The
triage order goes from plumbing to learning, because a plumbing fault shows up downstream as a
learning symptom, never the reverse:

    buffer_depth -> sandbox_tail -> grader_share -> sync_share -> staleness
      -> entropy -> kl -> learning_signal -> version_order -> sync_verification -> failures

Causes are named once: when the trainer starves *because* a rollout-side check (sandbox tail,
grader, sync) is the problem, the starvation is reported as a warning that points at it. The same
holds for staleness caused by a trainer that lags rollouts. docs/runbook.md is organised by these
check names.

    python -m rlpipe.observe.doctor RUN [--database-url URL]     # exit status 1 when any check is a problem
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from rich.console import Console
from rich.table import Table
from sqlalchemy.orm import Session

from rlpipe.observe import queries as q

Status = Literal["ok", "warn", "problem"]

# -- check names (docs/runbook.md refers to them) ---------------------------------------------------
BUFFER_DEPTH = "buffer_depth"
SANDBOX_TAIL = "sandbox_tail"
GRADER_SHARE = "grader_share"
SYNC_SHARE = "sync_share"
STALENESS = "staleness"
ENTROPY = "entropy"
KL = "kl"
LEARNING_SIGNAL = "learning_signal"
VERSION_ORDER = "version_order"
SYNC_VERIFICATION = "sync_verification"
FAILURES = "failures"
ROLLOUT_SIDE_CAUSES = (SANDBOX_TAIL, GRADER_SHARE, SYNC_SHARE)
"""Checks that explain a starved trainer: each slows the production of groups."""

# -- thresholds -------------------------------------------------------------------------------------
MIN_STEPS_FOR_TRENDS = 6
"""Trends compare the first and last third of the steps; with fewer than 6 steps a third is one
or two noisy steps, so trend checks pass with a note instead."""
WAIT_PROBLEM_STEPS = 2.0
"""Optimiser steps a consumed group waited in the buffer (late in the run). In a balanced async
pipeline a group completes during the step before the one that trains on it (wait ~1); two or
more means rollouts run ahead and their data ages in the buffer."""
WAIT_GROWTH_STEPS = 1.0
"""Growth of that wait from the first to the last third of the run: rollouts produce faster than
the trainer consumes, and the backlog only stops at the staleness budget (or as dropped groups)."""
TRAINER_DUTY_BOUND = 0.5
"""Trainer duty (time inside train steps over its steady window, see queries.trainer_duty) while
data piles up: at least half means it runs steps back to back and is the bottleneck. The rest is
the turn-around between steps (the workflow hears a step finished and schedules the next): 0.1 s
on an idle machine, up to ~0.6 s on a loaded 2-core one, so a fast trainer never reaches 100%.
Below half, steps are not being run although data waits."""
TRAINER_IDLE_STARVED_WARN = 0.5
TRAINER_IDLE_STARVED_PROBLEM = 0.85
"""Async trainer outside a step over its steady window with no backlog: it waits for data
(starved). Generation usually dominates RL compute, so a trainer idle half the time is a capacity
hint (warn), not a fault; idle 85% of the time, the trainer's hardware is mostly wasted. Sync mode
idles by design (no training while rollouts run), so it is exempt."""
TOOL_TAIL_RATIO = 10.0
"""p99 / p50 of tool latency. A lognormal with sigma 1 already gives ~10; beyond it a few calls
take most of the time, and every group waits for its slowest sample."""
TOOL_SHARE_WARN = 0.3
"""Tools take this share of the groups' critical path: the tail now sets the pace of rollouts."""
TOOL_SHARE_PROBLEM = 0.5
"""Tools take over half the groups' time (tail or not): the sandbox is the rollout bottleneck."""
MIN_TOOL_CALLS = 20
"""A p99 of fewer calls is a single sample."""
GRADER_SHARE_WARN = 0.2
GRADER_SHARE_PROBLEM = 0.5
"""Grader busy time over all boxes' busy time. Generation and training should dominate; rule
graders take milliseconds. A grader with half of all busy time paces the pipeline. Measured on
the live tests: a 0.5 s judge 0.89; a rule grader on the tiny model 0.15, and up to 0.36 on a
loaded 2-core machine, where the grader box's own bookkeeping (Postgres, the run's environment)
stretches while the tiny model's generation stays short."""
SYNC_SHARE_WARN = 0.1
SYNC_SHARE_PROBLEM = 0.25
"""Share of the servers' time paused for weight syncs (pause to resume, reload included). A
paused server generates nothing, so a quarter of its time paused caps rollout throughput at three
quarters. Downloading and verifying happen while the server serves: a slow one costs staleness
(the staleness check), not throughput."""
STALENESS_MEAN_PROBLEM = 1.5
"""Mean staleness in optimiser steps. One-step-off data (mean <= 1) is the async design; beyond
1.5 most data was generated two or more updates ago and off-policy correction does the work."""
STALENESS_AT_BOUND_SHARE = 0.5
"""Share of consumed data at max_staleness (for a bound >= 2; with bound 1 that is the design):
the freshness rule binds, so groups get dropped and rollouts stall on the budget."""
STALENESS_WIDENING_STEPS = 1.0
"""Rise of mean staleness from the first to the last third of the run: the pipeline drifts."""
ENTROPY_COLLAPSE_RATIO = 0.3
ENTROPY_WARN_RATIO = 0.6
"""Last-third mean entropy over first-third mean. Entropy falls as a policy learns; losing 70% of
it in one run means sampling has become nearly greedy, and exploration (and the gradient) dies."""
KL_WARN = 0.05
KL_PROBLEM = 0.2
"""KL(sampler || trainer) per token, mean of the last third. Fresh weights give ~1e-3 (numerics);
0.05 means importance ratios routinely off by ~30%, 0.2 that the trainer optimises another policy."""
ZERO_STD_WARN = 0.6
ZERO_STD_PROBLEM = 0.9
"""Consumed groups whose samples all got the same reward: their GRPO advantages are zero, so
they add nothing to the gradient. At 90% the run barely learns, with no NaN to show for it."""
MIN_GROUPS_FOR_SIGNAL = 16
"""Below this many consumed groups the share is too noisy to call a problem (a warning at most): a
policy right 1 time in 10 gives all-wrong groups of 4 two times in three, so 8 such groups are all
uniform ~3% of the time by chance; with 16, ~0.1%."""
SERVER_LAG_WARN = 2
"""Published versions a server is behind at the end of the run; one is a sync in progress."""
FAILED_ATTEMPTS_WARN = 0.05
FAILED_ATTEMPTS_PROBLEM = 0.25
"""Failed activity attempts per box. Retries hide a few; a quarter failing wastes the box's time."""


@dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    evidence: Mapping[str, float | int | str]
    """The numbers from Postgres the verdict rests on."""
    verdict: str
    remedy: str = ""
    """The concrete change to make (empty when ok)."""
    symptom: str = ""
    """What kind of non-ok result this is, when a check has several (e.g. buffer_depth:
    'trainer_bound' or 'starved'); `attribute_causes` reads it."""


def doctor_exit_code(findings: Sequence[Finding]) -> int:
    """1 when any check is a problem (warnings do not fail), else 0: for CI and scripts."""
    return 1 if any(f.status == "problem" for f in findings) else 0


# -- the facts every check reads --------------------------------------------------------------------
@dataclass(frozen=True)
class RunFacts:
    """Everything the checks need, read once; the checks are pure functions of it."""

    info: q.RunInfo
    steps: list[q.StepRow]
    usage: dict[str, q.BoxUsage]
    waits: list[q.StepWait]
    depth_at_steps: list[int]
    """Groups in the buffer just before each step started."""
    groups: q.GroupCounts
    staleness: dict[int, int]
    staleness_by_step: list[q.StepStaleness]
    """With the bound each step claimed under: max_staleness can change mid-run."""
    trainer_duty: float | None
    tools: q.LatencyStats | None
    tool_share: float | None
    grades: q.GradeStats | None
    sync: q.SyncShare | None
    syncs: list[q.SyncRow]
    lags: list[q.ServerLag]
    versions: q.VersionAnomalies
    attempts: list[q.AttemptCounts]
    failures: list[q.FailureCount]

    @property
    def busy_total_s(self) -> float:
        return sum(u.busy_s for u in self.usage.values())

    def busy_fraction(self, box: str) -> float:
        return self.usage[box].busy_fraction if box in self.usage else 0.0


def gather_facts(s: Session, run_id: str) -> RunFacts:
    info = q.run_info(s, run_id)
    steps = q.step_metrics(s, run_id)
    depth = q.buffer_depth(s, run_id)
    return RunFacts(
        info=info, steps=steps, usage=q.box_usage(s, run_id),
        waits=q.buffer_waits(s, run_id), depth_at_steps=[q.depth_before(depth, st.started_at) for st in steps],
        groups=q.group_counts(s, run_id), staleness=q.staleness_histogram(s, run_id),
        staleness_by_step=q.staleness_by_step(s, run_id, info.max_staleness), trainer_duty=q.trainer_duty(s, run_id),
        tools=q.tool_latency_stats(s, run_id),
        tool_share=q.tool_share_of_group_time(s, run_id), grades=q.grade_stats(s, run_id),
        sync=q.sync_share(s, run_id), syncs=q.sync_timings(s, run_id), lags=q.version_lag(s, run_id),
        versions=q.version_anomalies(s, run_id), attempts=q.attempts_by_box(s, run_id),
        failures=q.failures_by_kind(s, run_id))


def thirds(values: Sequence[float]) -> tuple[float, float]:
    """Means of the first and the last third of a series (trend checks)."""
    n = max(len(values) // 3, 1)
    return statistics.fmean(values[:n]), statistics.fmean(values[-n:])


def _r(x: float, digits: int = 3) -> float:
    return round(x, digits)


# -- 1. buffer depth --------------------------------------------------------------------------------
def check_buffer_depth(f: RunFacts) -> Finding:
    """Is the trainer the bottleneck (data piles up and waits) or starved (no data, trainer idle)?"""
    if len(f.waits) < 2:
        return Finding(BUFFER_DEPTH, "ok", {"steps": len(f.waits)}, "too few steps to judge the buffer")
    early, late = thirds([w.mean_steps for w in f.waits])
    duty = f.trainer_duty if f.trainer_duty is not None else f.busy_fraction("trainer")
    depth = statistics.fmean(f.depth_at_steps) if f.depth_at_steps else 0.0
    evidence = {"wait_steps_early": _r(early, 2), "wait_steps_late": _r(late, 2),
                "depth_at_step_start": _r(depth, 1), "groups_per_step": f.info.groups_per_step,
                "trainer_duty": _r(duty), "dropped_groups": f.groups.dropped}
    if late >= WAIT_PROBLEM_STEPS and late - early >= WAIT_GROWTH_STEPS:
        if duty >= TRAINER_DUTY_BOUND:
            return Finding(BUFFER_DEPTH, "problem", evidence,
                           f"groups wait longer and longer in the buffer ({early:.1f} -> {late:.1f} steps) while the "
                           f"trainer runs steps {duty:.0%} of the time and turns around between them the rest: "
                           "the trainer is slower than the rollouts",
                           "speed up the trainer (batch.world_size data-parallel ranks, fewer batch.micro_batches; "
                           "more groups per step amortise the turn-around) or lower rollout.max_concurrent_groups "
                           "so rollouts stop producing data that only ages", symptom="trainer_bound")
        return Finding(BUFFER_DEPTH, "problem", evidence,
                       f"groups wait longer and longer in the buffer ({early:.1f} -> {late:.1f} steps) while the "
                       f"trainer is outside a step {1 - duty:.0%} of the time: steps are not being scheduled",
                       "check that the trainer worker is up and polling the trainer queue, and the TrainingRun "
                       "workflow's phase (`rlpipe run status`)", symptom="unscheduled")
    if late >= WAIT_PROBLEM_STEPS:
        return Finding(BUFFER_DEPTH, "warn", evidence,
                       f"groups wait {late:.1f} steps in the buffer (steady): their data ages before it is trained on",
                       "lower rollout.max_concurrent_groups or max_staleness so rollouts run less far ahead",
                       symptom="steady_backlog")
    if f.info.mode == "async" and 1 - duty >= TRAINER_IDLE_STARVED_WARN:
        status: Status = "problem" if 1 - duty >= TRAINER_IDLE_STARVED_PROBLEM else "warn"
        return Finding(BUFFER_DEPTH, status, evidence,
                       f"the trainer is outside a step {1 - duty:.0%} of the time with no backlog (groups wait "
                       f"{late:.1f} steps): it is starved, the rollouts are the bottleneck",
                       "add rollout capacity (inference servers, rollout workers, rollout.max_concurrent_groups) "
                       "or raise max_staleness so rollouts may run further ahead", symptom="starved")
    return Finding(BUFFER_DEPTH, "ok", evidence,
                   f"groups wait {late:.1f} steps in the buffer, trainer in a step {duty:.0%} of the time")


# -- 2. sandbox tail --------------------------------------------------------------------------------
def check_sandbox_tail(f: RunFacts) -> Finding:
    """Do a few slow tool calls hold whole groups back?"""
    if f.tools is None or f.tools.n < MIN_TOOL_CALLS:
        return Finding(SANDBOX_TAIL, "ok", {"tool_calls": f.tools.n if f.tools else 0},
                       "too few tool calls to judge their latency tail")
    ratio = f.tools.p99 / max(f.tools.p50, 1e-6)
    share = f.tool_share or 0.0
    evidence = {"tool_calls": f.tools.n, "p50_s": _r(f.tools.p50), "p99_s": _r(f.tools.p99),
                "max_s": _r(f.tools.max), "p99_over_p50": _r(ratio, 1), "tool_share_of_group_time": _r(share)}
    tail = ratio >= TOOL_TAIL_RATIO
    if tail and share >= TOOL_SHARE_WARN:
        return Finding(SANDBOX_TAIL, "problem", evidence,
                       f"tool latency has a heavy tail (p99 {f.tools.p99:.2f}s = {ratio:.0f}x p50) and tools take "
                       f"{share:.0%} of the groups' time: groups wait for their slowest sandbox call",
                       "set rollout.group_deadline_s with rollout.straggler_policy = 'partial', add "
                       "rollout.hedge_samples, or lower rollout.tool_timeout_s; scale the sandbox workers")
    if share >= TOOL_SHARE_PROBLEM:
        return Finding(SANDBOX_TAIL, "warn", evidence,
                       f"tools take {share:.0%} of the groups' time, evenly (no heavy tail)",
                       "scale the sandbox workers (more processes, a warm sandbox pool)")
    if tail:
        return Finding(SANDBOX_TAIL, "warn", evidence,
                       f"tool latency has a tail (p99 = {ratio:.0f}x p50) but it costs only {share:.0%} of group time",
                       "watch it; rollout.group_deadline_s bounds it if it grows")
    return Finding(SANDBOX_TAIL, "ok", evidence, f"p99 tool call {f.tools.p99:.2f}s, {share:.0%} of group time")


# -- 3. grader share --------------------------------------------------------------------------------
def check_grader_share(f: RunFacts) -> Finding:
    """Is reward computation eating the compute budget?"""
    if f.busy_total_s <= 0:
        return Finding(GRADER_SHARE, "ok", {}, "no activity spans recorded")
    share = f.usage["grader"].busy_s / f.busy_total_s if "grader" in f.usage else 0.0
    evidence: dict[str, float | int | str] = {"grader_share": _r(share), "grader_busy": _r(f.busy_fraction("grader"))}
    if f.grades is not None:
        evidence |= {"grade_p50_s": _r(f.grades.latency.p50), "grade_p99_s": _r(f.grades.latency.p99),
                     "cache_hit_rate": _r(f.grades.cache_hit_rate)}
    remedy = ("add grader workers or raise grader.concurrency; grade with a cheaper judge model; "
              "keep the grader cache on for repeated prompts")
    if share >= GRADER_SHARE_PROBLEM:
        return Finding(GRADER_SHARE, "problem", evidence,
                       f"the grader takes {share:.0%} of all boxes' busy time: grading paces the pipeline", remedy)
    if share >= GRADER_SHARE_WARN:
        return Finding(GRADER_SHARE, "warn", evidence, f"the grader takes {share:.0%} of all busy time", remedy)
    return Finding(GRADER_SHARE, "ok", evidence, f"the grader takes {share:.0%} of all busy time")


# -- 4. sync share ----------------------------------------------------------------------------------
def check_sync_share(f: RunFacts) -> Finding:
    """Are weight syncs pausing generation for long?"""
    if f.sync is None:
        return Finding(SYNC_SHARE, "ok", {"syncs": 0}, "no weight syncs recorded")
    pauses = [r.pause_s for r in f.syncs if r.pause_s is not None]
    totals = [r.total_s for r in f.syncs if r.total_s is not None]
    paused = f.sync.paused_share
    evidence = {"paused_share": _r(paused), "sync_share": _r(f.sync.share), "syncs": f.sync.n_syncs,
                "sync_interval": f.info.sync_interval,
                "pause_p50_s": _r(statistics.median(pauses)) if pauses else "-",
                "sync_p50_s": _r(statistics.median(totals)) if totals else "-"}
    summary = (f"servers are paused for weight syncs {paused:.0%} of the time "
               f"(a sync is in progress {f.sync.share:.0%} of the wall time)")
    remedy = (f"raise sync.interval (now {f.info.sync_interval}; max_staleness must stay >= interval - 1), "
              "or make syncs cheaper: sync.pause_mode = 'keep', checkpoints near the servers")
    if paused >= SYNC_SHARE_PROBLEM:
        return Finding(SYNC_SHARE, "problem", evidence, f"{summary}: generation stops that long", remedy)
    if paused >= SYNC_SHARE_WARN:
        return Finding(SYNC_SHARE, "warn", evidence, summary, remedy)
    return Finding(SYNC_SHARE, "ok", evidence, summary)


# -- 5. staleness -----------------------------------------------------------------------------------
def check_staleness(f: RunFacts) -> Finding:
    """How old is the data the trainer learns from, and is the freshness rule respected?"""
    n = sum(f.staleness.values())
    if n == 0:
        return Finding(STALENESS, "ok", {"consumed": 0}, "no consumed trajectories yet")
    # each step is judged by the bound it claimed under (a schedule update may change it mid-run)
    by_step = f.staleness_by_step  # from the same view as the histogram: not empty either
    bounds = q.describe_bounds(by_step)
    in_force = sorted({x.bound for x in by_step})
    bound: int | str = in_force[0] if len(in_force) == 1 else bounds  # the evidence: the bound(s) in force
    mean = sum(lag * c for lag, c in f.staleness.items()) / n
    worst = max(f.staleness)
    at_bound = sum(x.at_bound for x in by_step) / n
    # data at a bound of 1 is the async design: only bounds >= 2 count towards the binding rule
    at_binding_bound = sum(x.at_bound for x in by_step if x.bound >= 2) / n
    evidence: dict[str, float | int | str] = {
        "mean_steps": _r(mean, 2), "max_steps": worst, "max_staleness": bound,
        "at_bound_share": _r(at_bound), "sync_interval": f.info.sync_interval, "dropped_groups": f.groups.dropped}
    over = [x for x in by_step if x.over_bound]
    if over:
        w = max(over, key=lambda x: (x.max - x.bound, x.max))
        evidence |= {"over_bound_trajectories": sum(x.over_bound for x in over), "over_bound_steps": len(over),
                     "worst_step": w.step, "worst_step_max_staleness": w.bound}
        return Finding(STALENESS, "problem", evidence,
                       f"step {w.step} trained on data {w.max} steps stale, above the max_staleness {w.bound} it "
                       f"claimed under ({evidence['over_bound_trajectories']} trajectories over their step's bound): "
                       "the freshness rule was not enforced",
                       "a bug: check claim_batch's min_trained_steps and the rollout budget")
    if mean >= STALENESS_MEAN_PROBLEM or at_binding_bound >= STALENESS_AT_BOUND_SHARE:
        return _stale_data(f, evidence, mean, at_bound, by_step)
    if len(f.staleness_by_step) >= MIN_STEPS_FOR_TRENDS:
        early, late = thirds([x.mean for x in f.staleness_by_step])
        evidence |= {"mean_early": _r(early, 2), "mean_late": _r(late, 2)}
        if late - early >= STALENESS_WIDENING_STEPS:
            return Finding(STALENESS, "warn", evidence,
                           f"staleness drifts up from {early:.1f} to {late:.1f} steps over the run",
                           f"see {BUFFER_DEPTH}: data is waiting longer and longer")
    in_words = f"(bound {bounds})" if len(in_force) == 1 else f"(bounds {bounds})"
    return Finding(STALENESS, "ok", evidence, f"mean staleness {mean:.2f} steps, max {worst} {in_words}")


def _stale_data(f: RunFacts, evidence: dict[str, float | int | str], mean: float, at_bound: float,
                by_step: Sequence[q.StepStaleness]) -> Finding:
    """Name why the data is stale. Staleness = steps the group waited in the buffer + steps that
    passed while it was generated + how far the servers' weights lagged the trainer when it
    started; the buffer wait is measured, the rest is sync interval and generation time."""
    wait = statistics.fmean(w.mean_steps for w in f.waits) if f.waits else 0.0
    evidence |= {"buffer_wait_steps": _r(wait, 2), "weights_and_generation_steps": _r(mean - wait, 2)}
    bound = max(x.bound for x in by_step)  # the loosest bound in force
    bounds = q.describe_bounds(by_step)
    at = f"the bound {bounds}" if len({x.bound for x in by_step}) == 1 else f"their step's bound: {bounds}"
    summary = f"the data is {mean:.1f} steps stale on average ({at_bound:.0%} at {at})"
    interval = f.info.sync_interval
    sync_remedy = (f"lower sync.interval (now {interval}; check sync_share first) or raise max_staleness if this "
                   "much off-policy data is intended")
    if interval > 1 and bound <= interval:
        # The bound may not go below interval - 1, so it is the interval that lets rollouts make
        # the data of the coming steps from one old version (whether it then waits in the buffer
        # or is generated late).
        return Finding(STALENESS, "problem", evidence,
                       f"{summary}: sync.interval {interval} keeps the servers on one version for {interval} steps "
                       f"and the freshness bound {bound} is pinned to it", sync_remedy,
                       symptom="sync_interval")
    if wait >= mean / 2:
        return Finding(STALENESS, "problem", evidence,
                       f"{summary}, {wait:.1f} of them waiting in the buffer: rollouts run far ahead of the trainer",
                       "lower max_staleness (rollouts wait instead of producing stale data) or speed up the trainer",
                       symptom="buffer_wait")
    if interval > 1:
        return Finding(STALENESS, "problem", evidence,
                       f"{summary}, mostly before the data reached the buffer: sync.interval {interval} "
                       "keeps the servers on old weights for several steps", sync_remedy, symptom="sync_interval")
    return Finding(STALENESS, "problem", evidence,
                   f"{summary}, mostly while it was generated: a group takes several optimiser steps to finish",
                   f"shorten groups (rollout.group_deadline_s, fewer env.max_turns); see {SANDBOX_TAIL}",
                   symptom="slow_generation")


# -- 6. entropy and KL ------------------------------------------------------------------------------
def _trend(name: str, values: list[float]) -> tuple[float, float] | Finding:
    """(first-third mean, last-third mean), or an ok Finding when the run is too short to tell."""
    if len(values) < MIN_STEPS_FOR_TRENDS:
        return Finding(name, "ok", {"steps_with_value": len(values)},
                       f"fewer than {MIN_STEPS_FOR_TRENDS} steps: no trend to judge")
    return thirds(values)


def check_entropy(f: RunFacts) -> Finding:
    """Has the policy collapsed to near-greedy sampling?"""
    trend = _trend(ENTROPY, [s.entropy for s in f.steps if s.entropy is not None])
    if isinstance(trend, Finding):
        return trend
    early, late = trend
    ratio = late / early if early > 0 else 1.0
    evidence = {"entropy_early": _r(early), "entropy_late": _r(late), "late_over_early": _r(ratio)}
    remedy = "lower optim.lr, add loss.entropy_coef, or raise loss.clip_high (DAPO clip-higher keeps exploring)"
    if ratio < ENTROPY_COLLAPSE_RATIO:
        return Finding(ENTROPY, "problem", evidence,
                       f"entropy collapsed from {early:.3f} to {late:.3f} nats: the policy has stopped exploring",
                       remedy)
    if ratio < ENTROPY_WARN_RATIO:
        return Finding(ENTROPY, "warn", evidence, f"entropy fell to {ratio:.0%} of its start", remedy)
    return Finding(ENTROPY, "ok", evidence, f"entropy {early:.3f} -> {late:.3f} nats")


def check_kl(f: RunFacts) -> Finding:
    """Do the sampler and the trainer still agree on the policy?"""
    trend = _trend(KL, [s.kl_sampler for s in f.steps if s.kl_sampler is not None])
    if isinstance(trend, Finding):
        return trend
    early, late = trend
    evidence = {"kl_early": _r(early, 4), "kl_late": _r(late, 4)}
    remedy = ("lower sync.interval / max_staleness (fresher data), use loss.off_policy = 'truncated_is', "
              "and check that sampling.temperature equals loss.temperature")
    if late >= KL_PROBLEM:
        return Finding(KL, "problem", evidence,
                       f"KL(sampler || trainer) reached {late:.3f} per token: the trainer optimises a policy the "
                       "sampler no longer is", remedy)
    if late >= KL_WARN:
        return Finding(KL, "warn", evidence, f"KL(sampler || trainer) rose to {late:.3f} per token", remedy)
    return Finding(KL, "ok", evidence, f"KL(sampler || trainer) {late:.4f} per token")


def check_learning_signal(f: RunFacts) -> Finding:
    return learning_signal(f.groups)


def learning_signal(groups: q.GroupCounts) -> Finding:
    """Do the groups carry any advantage at all?"""
    if groups.consumed == 0:
        return Finding(LEARNING_SIGNAL, "ok", {"consumed_groups": 0}, "no consumed groups yet")
    share = groups.zero_std_consumed / groups.consumed
    evidence = {"consumed_groups": groups.consumed, "zero_std_share": _r(share),
                "uninformative_dropped": groups.uninformative_dropped}
    remedy = ("make the task's difficulty match the policy (env.difficulty), raise rollout.group_size, "
              "grade with partial credit, or drop such groups before training (rollout.dynamic_sampling)")
    if share >= ZERO_STD_PROBLEM and groups.consumed < MIN_GROUPS_FOR_SIGNAL:
        return Finding(LEARNING_SIGNAL, "warn", evidence,
                       f"{share:.0%} of the groups carry no advantage, but only {groups.consumed} were consumed: "
                       f"too few to judge (fewer than {MIN_GROUPS_FOR_SIGNAL})", remedy)
    if share >= ZERO_STD_PROBLEM:
        return Finding(LEARNING_SIGNAL, "problem", evidence,
                       f"{share:.0%} of the groups got one reward for every sample: their advantages are zero and "
                       "the run barely learns", remedy)
    if share >= ZERO_STD_WARN:
        return Finding(LEARNING_SIGNAL, "warn", evidence, f"{share:.0%} of the groups carry no advantage", remedy)
    return Finding(LEARNING_SIGNAL, "ok", evidence, f"{share:.0%} of the groups carry no advantage")


# -- 7. versions ------------------------------------------------------------------------------------
def check_version_order(f: RunFacts) -> Finding:
    """Do versions only move forward, on every server, and are they all published?"""
    backwards: list[str] = []
    last_ok: dict[str, int] = {}
    for sync in f.syncs:  # in start order
        if sync.status != "ok":
            continue
        if sync.server in last_ok and sync.version <= last_ok[sync.server]:
            backwards.append(f"{sync.server}: v{last_ok[sync.server]} -> v{sync.version}")
        last_ok[sync.server] = max(sync.version, last_ok.get(sync.server, sync.version))
    latest = f.versions.latest_published
    unpublished = sorted({s.version for s in f.syncs if latest is None or s.version > latest})
    lag = max((x.lag for x in f.lags), default=0)
    evidence: dict[str, float | int | str] = {
        "servers": len(last_ok), "latest_published": latest if latest is not None else "-",
        "syncs_backwards": len(backwards), "turns_backwards": f.versions.turns_version_backwards,
        "trajectories_unpublished_version": f.versions.trajectories_unpublished_version, "max_server_lag": lag}
    if backwards or unpublished or f.versions.turns_version_backwards or f.versions.trajectories_unpublished_version:
        detail = "; ".join(backwards[:3]) or (f"synced unpublished versions {unpublished}" if unpublished else
                                              "turns or trajectories carry impossible versions")
        return Finding(VERSION_ORDER, "problem", evidence,
                       f"policy versions went backwards or were never published ({detail}): trajectories may be "
                       "tagged with the wrong version", "a bug: check the sync sidecar's ordering (it must refuse "
                       "versions older than what it holds) and the version recorded by generate")
    if lag >= SERVER_LAG_WARN:
        return Finding(VERSION_ORDER, "warn", evidence, f"a server is {lag} versions behind the latest published",
                       "check that server's sync sidecar (sync_events.error, `rlpipe workers status`)")
    return Finding(VERSION_ORDER, "ok", evidence, "versions move forward on every server")


def check_sync_verification(f: RunFacts) -> Finding:
    """Do the servers really hold what was published?"""
    by_status = {status: sum(1 for s in f.syncs if s.status == status)
                 for status in ("ok", "failed", "rolled_back", "refused")}
    diffs = [s.probe_max_abs_diff for s in f.syncs if s.probe_max_abs_diff is not None]
    # each sync against its own bound: servers of different dtypes are held to different ones
    shares = [s.probe_max_abs_diff / s.probe_tolerance for s in f.syncs
              if s.probe_max_abs_diff is not None and s.probe_tolerance]
    evidence: dict[str, float | int | str] = {**by_status, "probe_max_abs_diff": _r(max(diffs), 4) if diffs else "-",
                                              "probe_diff_over_bound": _r(max(shares), 3) if shares else "-"}
    rejected = by_status["rolled_back"] + by_status["refused"]
    if rejected:
        return Finding(SYNC_VERIFICATION, "problem", evidence,
                       f"{rejected} syncs failed verification (rolled back or refused): a server's logprobs did not "
                       "match the trainer's on the probe", "inspect sync_events.error; check the checkpoint's "
                       "dtype/format and the prefix-cache reset; set sync.verify_tolerance only if the diff is "
                       "numerical noise of a server dtype without a measured bound (weights/tolerance.py)")
    if by_status["failed"]:
        return Finding(SYNC_VERIFICATION, "warn", evidence, f"{by_status['failed']} syncs failed and were retried",
                       "inspect sync_events.error and the sidecar's log")
    return Finding(SYNC_VERIFICATION, "ok", evidence, f"{by_status['ok']} syncs verified")


def check_failures(f: RunFacts) -> Finding:
    """Are retries hiding a box that fails a lot?"""
    if not f.attempts:
        return Finding(FAILURES, "ok", {}, "no activity attempts recorded")
    rates = {a.box: a.failed / a.attempts for a in f.attempts if a.attempts}
    box, worst = max(rates.items(), key=lambda kv: kv[1])
    evidence: dict[str, float | int | str] = {f"{b}_failed": _r(r) for b, r in rates.items() if r > 0}
    evidence |= {f"{x.kind}/{x.activity or '-'}/{x.error_type}": x.failures for x in f.failures[:3]}
    remedy = "see docs/sql.md 'failures by activity and reason' for the messages"
    if worst >= FAILED_ATTEMPTS_PROBLEM:
        return Finding(FAILURES, "problem", evidence, f"{worst:.0%} of {box} attempts fail", remedy)
    if worst >= FAILED_ATTEMPTS_WARN:
        return Finding(FAILURES, "warn", evidence, f"{worst:.0%} of {box} attempts fail (retried)", remedy)
    return Finding(FAILURES, "ok", evidence, "few failed attempts" if worst else "no failed attempts")


# -- the walk ---------------------------------------------------------------------------------------
CHECKS: tuple[Callable[[RunFacts], Finding], ...] = (
    check_buffer_depth, check_sandbox_tail, check_grader_share, check_sync_share, check_staleness,
    check_entropy, check_kl, check_learning_signal, check_version_order, check_sync_verification, check_failures)
"""In triage order."""


def attribute_causes(findings: list[Finding]) -> list[Finding]:
    """Name each cause once: a starved trainer explained by a rollout-side problem, and staleness
    explained by a trainer that lags the rollouts, become warnings that point at their cause."""
    problems = {f.check for f in findings if f.status == "problem"}
    rollout_causes = [c for c in ROLLOUT_SIDE_CAUSES if c in problems]
    out = []
    for f in findings:
        if f.check == BUFFER_DEPTH and f.status != "ok" and f.symptom == "starved" and rollout_causes:
            f = replace(f, status="warn", verdict=f"{f.verdict} (caused by {', '.join(rollout_causes)})",
                        remedy=f"fix {', '.join(rollout_causes)} first")
        elif f.check == STALENESS and f.status == "problem" and f.symptom == "buffer_wait" and BUFFER_DEPTH in problems:
            f = replace(f, status="warn", verdict=f"{f.verdict} (caused by {BUFFER_DEPTH})",
                        remedy=f"fix {BUFFER_DEPTH} first")
        out.append(f)
    return out


def diagnose_facts(facts: RunFacts) -> list[Finding]:
    return attribute_causes([check(facts) for check in CHECKS])


def diagnose(s: Session, run_id: str) -> list[Finding]:
    """Every check of the triage order, in order, for one run."""
    return diagnose_facts(gather_facts(s, run_id))


# -- output -----------------------------------------------------------------------------------------
STATUS_STYLE = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "problem": "[bold red]problem[/]"}


def findings_table(findings: Sequence[Finding], title: str = "rlpipe doctor") -> Table:
    table = Table(title=title, show_lines=True)
    for column in ("check", "status", "evidence", "verdict", "remedy"):
        table.add_column(column, overflow="fold")
    for f in findings:
        evidence = "\n".join(f"{k}={v}" for k, v in f.evidence.items())
        table.add_row(f.check, STATUS_STYLE[f.status], evidence, f.verdict, f.remedy)
    return table


def print_findings(findings: Sequence[Finding], run_id: str, console: Console | None = None) -> None:
    (console or Console()).print(findings_table(findings, title=f"rlpipe doctor: {run_id}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlpipe.observe.doctor",
                                     description="Diagnose one run from Postgres.")
    parser.add_argument("run", help="run name")
    parser.add_argument("--database-url", help="default: DATABASE_URL or the local stack's database")
    args = parser.parse_args(argv)
    from rlpipe.infra.endpoints import database_url  # the command line's default: where the workers write
    from rlpipe.storage.db import Database

    db = Database(database_url(args.database_url))
    try:
        with db.begin() as s:
            findings = diagnose(s, args.run)
    finally:
        db.dispose()
    print_findings(findings, args.run)
    return doctor_exit_code(findings)


if __name__ == "__main__":
    raise SystemExit(main())
