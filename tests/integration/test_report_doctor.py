"""The doctor names the right problem for each pathology, and the report draws a healthy run.

Each synthetic run comes from a tiny deterministic model of the pipeline (`simulate`): rollout
slots generate groups within the staleness budget, a sandbox answers tool calls, a grader with a
number of slots grades each group, the trainer claims each step's groups in order, and published
versions are synced to two servers. A pathology is one or two changed fields of the healthy
profile, so each reads as its cause:

    SLOW_GRADER         one grader slot, 6 s per group      -> grader_share
    SANDBOX_TAIL        4% of tool calls take 30-60 s       -> sandbox_tail
    LONG_SYNC_INTERVAL  sync every 4 steps, bound 4         -> staleness (rollouts keep pace, weights lag)
    SLOW_TRAINER        trainer slower than the rollouts    -> buffer_depth
    COSTLY_SYNC         4 s syncs every 8 s step            -> sync_share
    ENTROPY_COLLAPSE    entropy falls 25% per step          -> entropy
    REJECTED_SYNC       two syncs fail verification         -> sync_verification

The rows go into a real, migrated Postgres; the doctor and the report read them back through
their SQL, views included.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session

from rlpipe.observe import doctor, invariants
from rlpipe.observe import queries as q
from rlpipe.observe.metrics import PipelineMetrics
from rlpipe.observe.report import write_report
from rlpipe.schemas.config import RolloutConfig, RunConfig, SyncConfig
from rlpipe.schemas.tables import (
    ActivitySpan,
    EvalResult,
    Grade,
    PolicyVersion,
    RolloutGroup,
    Run,
    SyncEvent,
    TrainStep,
    Trajectory,
    Turn,
)

pytestmark = pytest.mark.stack

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TOKENS_PER_TURN = 8
TOOL_OUTPUT_TOKENS = 4
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def lognormal(median_s: float, sigma: float) -> Callable[[random.Random], float]:
    return lambda rng: rng.lognormvariate(math.log(median_s), sigma)


def heavy_tail(rng: random.Random) -> float:
    """Most calls 0.2 s; 4% hang for 30-60 s (a remote sandbox's long tail)."""
    return rng.uniform(30.0, 60.0) if rng.random() < 0.04 else rng.lognormvariate(math.log(0.2), 0.3)


@dataclass(frozen=True)
class Profile:
    """How a synthetic run behaves (seconds unless said otherwise)."""

    mode: str = "async"
    max_staleness: int = 1
    sync_interval: int = 1
    steps: int = 12
    groups_per_step: int = 4
    group_size: int = 4
    rollout_slots: int = 8
    """Groups generating at once."""
    turns: int = 2
    """Model turns per sample; a tool call follows every turn but the last."""
    generate_s: float = 1.0
    tool_s: Callable[[random.Random], float] = field(default=lognormal(0.2, 0.3))
    grader_slots: int = 4
    grade_s: float = 0.2
    """Grading one group."""
    train_s: float = 8.0
    sync_s: float = 0.5
    servers: tuple[str, ...] = ("0", "1")
    rejected_syncs: frozenset[int] = frozenset()
    """Versions that the last server rolls back (its verification failed)."""
    entropy_at: Callable[[int], float] = field(default=lambda step: 1.5 - 0.02 * step)
    evals: bool = False


HEALTHY = Profile(evals=True)
SLOW_GRADER = replace(HEALTHY, grader_slots=1, grade_s=6.0)
SANDBOX_TAIL = replace(HEALTHY, turns=3, tool_s=heavy_tail)
LONG_SYNC_INTERVAL = replace(HEALTHY, sync_interval=4, max_staleness=4, rollout_slots=1, train_s=9.0)
SLOW_TRAINER = replace(HEALTHY, max_staleness=8, rollout_slots=1, train_s=16.0)
COSTLY_SYNC = replace(HEALTHY, sync_s=4.0)
ENTROPY_COLLAPSE = replace(HEALTHY, entropy_at=lambda step: 1.5 * 0.75**step)
REJECTED_SYNC = replace(HEALTHY, rejected_syncs=frozenset({3, 7}))


# -- the simulated timeline -------------------------------------------------------------------------
@dataclass
class Sim:
    """Rows of one run, with times as seconds since T0, before they become database rows."""

    run: str
    p: Profile
    rng: random.Random
    versions: list[tuple[int, float]] = field(default_factory=lambda: [(0, 0.0)])
    """(trained_steps, live_at) per version: when the servers hold it."""
    groups: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    syncs: list[dict[str, Any]] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)

    def span(self, box: str, activity: str, t0: float, t1: float) -> None:
        self.spans.append({"box": box, "activity": activity, "t0": t0, "t1": t1})

    def version_live_at(self, t: float) -> int:
        return max(v for v, (_, live) in enumerate(self.versions) if live <= t)

    def first_live_with(self, trained: int) -> float:
        """When weights with at least `trained` optimiser steps are live (the rollout budget)."""
        return min(live for steps, live in self.versions if steps >= trained)


def simulate_group(sim: Sim, index: int, start: float, grader_free: list[float]) -> tuple[float, dict[str, Any]]:
    """One group: G samples in parallel, each turn a generate span then a tool span; then grading."""
    p, rng = sim.p, sim.rng
    version = sim.version_live_at(start)
    samples = []
    for _ in range(p.group_size):
        t, turns = start, []
        for turn in range(p.turns):
            gen = p.generate_s * rng.uniform(0.8, 1.2)
            sim.span("rollout", "generate", t, t + gen)
            t += gen
            tool = p.tool_s(rng) if turn < p.turns - 1 else None
            if tool is not None:
                sim.span("sandbox", "run_tool", t, t + tool)
                t += tool
            turns.append({"generate_s": gen, "tool_s": tool, "at": t})
        samples.append({"turns": turns, "end": t, "reward": rng.random()})
    generated = max(x["end"] for x in samples)
    grade_start = max(heapq.heappop(grader_free), generated)
    graded = grade_start + p.grade_s
    heapq.heappush(grader_free, graded)
    sim.span("grader", "grade_group", grade_start, graded)
    sim.span("persist", "finish_group", graded, graded + 0.05)
    return generated, {"index": index, "version": version, "start": start, "completed": graded + 0.05,
                       "samples": samples}


def simulate(run: str, p: Profile, seed: int = 7) -> Sim:
    """Steps in order: schedule the step's groups (rollout slots, staleness budget), grade them,
    train when they are all in, publish every sync interval and sync each server."""
    sim = Sim(run, p, random.Random(seed))
    rollout_free = [0.0] * p.rollout_slots
    grader_free = [0.0] * p.grader_slots
    trainer_free = 0.0
    for k in range(1, p.steps + 1):
        budget_at = sim.first_live_with(k - 1 - p.max_staleness)
        batch = []
        for i in range((k - 1) * p.groups_per_step, k * p.groups_per_step):
            start = max(heapq.heappop(rollout_free), budget_at)
            generated, group = simulate_group(sim, i, start, grader_free)
            heapq.heappush(rollout_free, generated)
            batch.append(group)
        started = max(trainer_free, max(g["completed"] for g in batch))
        finished = started + p.train_s * sim.rng.uniform(0.95, 1.05)
        trainer_free = finished
        sim.span("trainer", "train_step", started, finished)
        published = None
        if k % p.sync_interval == 0 or k == p.steps:
            published = len(sim.versions)
            sim.versions.append((k, finished + p.sync_s))
            for server in p.servers:
                sim.syncs.append({"version": published, "server": server, "t0": finished, "t1": finished + p.sync_s})
                sim.span("sync", "sync_weights", finished, finished + p.sync_s)
        for g in batch:
            g["claimed_step"], g["consumed"] = k, finished
        sim.groups += batch
        sim.steps.append({"step": k, "started": started, "finished": finished, "published": published,
                          "policy_version": sim.version_live_at(started), "groups": batch})
    return sim


# -- into Postgres ----------------------------------------------------------------------------------
TrajectoryRef = tuple[dict[str, Any], dict[str, Any], int]
"""(simulated group, simulated sample, trajectories.id)"""


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def insert_returning_ids(s: Session, table: Any, rows: list[dict[str, Any]]) -> list[int]:
    return list(s.scalars(sa.insert(table).returning(table.id, sort_by_parameter_order=True), rows))


def insert_run(s: Session, name: str, p: Profile) -> None:
    config = RunConfig(name=name, mode=p.mode, steps=p.steps, max_staleness=p.max_staleness,
                       rollout=RolloutConfig(group_size=p.group_size, groups_per_step=p.groups_per_step),
                       sync=SyncConfig(interval=p.sync_interval))
    s.execute(sa.insert(Run).values(id=name, workflow_id=f"run-{name}", mode=p.mode,
                                    config=config.model_dump(mode="json"), config_sha256=sha(name)))


def insert_sim(s: Session, sim: Sim) -> None:
    """Every table the doctor and the report read, in foreign-key order."""
    run, p = sim.run, sim.p
    insert_run(s, run, p)
    for version, (trained, live) in enumerate(sim.versions):
        s.execute(sa.insert(PolicyVersion).values(run_id=run, version=version, trained_steps=trained,
                                                  checkpoint_key=f"{run}/v{version}", sha256=sha(f"{run}{version}"),
                                                  size_bytes=1000, created_at=at(live)))
    insert_turns_and_grades(s, sim, insert_groups_and_trajectories(s, sim))
    insert_steps(s, sim)
    s.execute(sa.insert(SyncEvent), [
        {"run_id": run, "version": x["version"], "server": x["server"], "bytes": 1000,
         "status": "rolled_back" if x["version"] in p.rejected_syncs and x["server"] == p.servers[-1] else "ok",
         "download_s": 0.1 * p.sync_s, "pause_s": 0.7 * p.sync_s, "reload_s": 0.6 * p.sync_s,
         "verify_s": 0.2 * p.sync_s, "total_s": p.sync_s, "probe_max_abs_diff": 1e-3,
         "started_at": at(x["t0"]), "finished_at": at(x["t1"])} for x in sim.syncs])
    s.execute(sa.insert(ActivitySpan), [
        {"run_id": run, "box": x["box"], "activity": x["activity"], "workflow_id": f"wf-{run}",
         "activity_id": str(i), "attempt": 1, "worker": "sim:1", "ok": True, "started_at": at(x["t0"]),
         "finished_at": at(x["t1"])} for i, x in enumerate(sim.spans)])
    if p.evals:
        s.execute(sa.insert(EvalResult), [
            {"run_id": run, "version": v, "split": "eval", "n_prompts": 100, "n_correct": 20 + 5 * v,
             "accuracy": (20 + 5 * v) / 100} for v in range(len(sim.versions))])


def insert_groups_and_trajectories(s: Session, sim: Sim) -> list[TrajectoryRef]:
    g_ids = insert_returning_ids(s, RolloutGroup, [
        {"run_id": sim.run, "group_index": g["index"], "prompt_index": g["index"], "task_id": f"t{g['index']}",
         "workflow_id": f"{sim.run}-g{g['index']}", "status": "completed", "n_samples": sim.p.group_size,
         "n_completed": sim.p.group_size, "min_version": g["version"], "max_version": g["version"],
         "reward_mean": mean(rewards_of(g)), "reward_std": std(rewards_of(g)),
         "claimed_step": g["claimed_step"], "started_at": at(g["start"]), "completed_at": at(g["completed"]),
         "consumed_at": at(g["consumed"])} for g in sim.groups])
    rows, owners = [], []
    for g, group_id in zip(sim.groups, g_ids, strict=True):
        rewards = rewards_of(g)
        for i, sample in enumerate(g["samples"]):
            mask = completion_mask(len(sample["turns"]))
            rows.append({"run_id": sim.run, "group_id": group_id, "sample_index": i, "status": "completed",
                         "prompt_ids": [1, 2, 3], "completion_ids": list(range(len(mask))), "loss_mask": mask,
                         "sampler_logprobs": [-0.5] * len(mask), "policy_version": g["version"],
                         "n_turns": len(sample["turns"]),
                         "finish_reason": "stop", "reward": sample["reward"],
                         "advantage": (sample["reward"] - mean(rewards)) / (std(rewards) + 1e-6),
                         "created_at": at(g["start"]), "completed_at": at(sample["end"])})
            owners.append((g, sample))
    ids = insert_returning_ids(s, Trajectory, rows)
    return [(g, sample, tid) for (g, sample), tid in zip(owners, ids, strict=True)]


def insert_turns_and_grades(s: Session, sim: Sim, trajectories: list[TrajectoryRef]) -> None:
    turns, grades = [], []
    for g, sample, tid in trajectories:
        for ti, turn in enumerate(sample["turns"]):
            tool = turn["tool_s"]
            calls = None if tool is None else [{"name": "calculator", "arguments": {"expression": "2+2"}, "error": None,
                                                "result": {"ok": True, "output": "4", "reason": None, "status": "ok",
                                                           "latency_s": tool}}]
            turns.append({"trajectory_id": tid, "turn_index": ti, "input_ids": [1, 2, 3],
                          "output_ids": list(range(TOKENS_PER_TURN)), "output_logprobs": [-0.5] * TOKENS_PER_TURN,
                          "output_text": "x", "finish_reason": "stop", "server": sim.p.servers[g["index"] % 2],
                          "version_before": g["version"], "version_after": g["version"],
                          "generate_latency_s": turn["generate_s"], "tool_calls": calls, "tool_latency_s": tool})
        grades.append({"trajectory_id": tid, "grader": "answer_match", "grader_version": "1",
                       "score": sample["reward"], "latency_s": sim.p.grade_s / sim.p.group_size, "cache_hit": False})
    s.execute(sa.insert(Turn), turns)
    s.execute(sa.insert(Grade), grades)


def insert_steps(s: Session, sim: Sim) -> None:
    """Train steps with health numbers that stay healthy: slowly falling entropy, KL that grows
    only with the data's staleness."""
    rows = []
    for st in sim.steps:
        k = st["step"]
        lags = [(k - 1) - sim.versions[g["version"]][0] for g in st["groups"] for _ in g["samples"]]
        rewards = [x["reward"] for g in st["groups"] for x in g["samples"]]
        rows.append({"run_id": sim.run, "step": k, "policy_version": st["policy_version"],
                     "published_version": st["published"], "n_groups": len(st["groups"]),
                     "n_trajectories": len(rewards), "n_tokens": len(rewards) * sim.p.turns * TOKENS_PER_TURN,
                     "loss": 0.1, "reward_mean": mean(rewards), "reward_std": std(rewards),
                     "response_length_mean": sim.p.turns * TOKENS_PER_TURN, "entropy": sim.p.entropy_at(k),
                     "kl_sampler": 0.002 * (1 + mean(lags)), "grad_norm": 0.5, "staleness_mean": mean(lags),
                     "staleness_max": max(lags), "metrics": {"clip_frac": 0.01},
                     "started_at": at(st["started"]), "finished_at": at(st["finished"])})
    s.execute(sa.insert(TrainStep), rows)


def rewards_of(group: dict[str, Any]) -> list[float]:
    return [x["reward"] for x in group["samples"]]


def completion_mask(turns: int) -> list[int]:
    """Model tokens 1, tool output tokens 0: each turn's output, then the tool's answer (not after the last)."""
    return ([1] * TOKENS_PER_TURN + [0] * TOOL_OUTPUT_TOKENS) * (turns - 1) + [1] * TOKENS_PER_TURN


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def std(xs: list[float]) -> float:
    m = mean(xs)
    return (sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5


# -- fixtures ---------------------------------------------------------------------------------------
PATHOLOGIES = {"slow-grader": (SLOW_GRADER, doctor.GRADER_SHARE),
               "sandbox-tail": (SANDBOX_TAIL, doctor.SANDBOX_TAIL),
               "long-sync-interval": (LONG_SYNC_INTERVAL, doctor.STALENESS),
               "slow-trainer": (SLOW_TRAINER, doctor.BUFFER_DEPTH),
               "costly-sync": (COSTLY_SYNC, doctor.SYNC_SHARE),
               "entropy-collapse": (ENTROPY_COLLAPSE, doctor.ENTROPY),
               "rejected-sync": (REJECTED_SYNC, doctor.SYNC_VERIFICATION)}


@pytest.fixture(scope="module")
def runs(migrated_db) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Profile name -> run id; every run has its own name, so reruns and other tests never collide."""
    suffix = uuid.uuid4().hex[:8]
    profiles = {"healthy": HEALTHY, **{name: p for name, (p, _) in PATHOLOGIES.items()}}
    names = {}
    with migrated_db.begin() as s:
        for name, profile in profiles.items():
            names[name] = f"obs-{name}-{suffix}"
            insert_sim(s, simulate(names[name], profile))
    return names


# -- the doctor -------------------------------------------------------------------------------------
def statuses(findings: list[doctor.Finding]) -> dict[str, str]:
    return {f.check: f.status for f in findings}


def test_healthy_run_passes_every_check(migrated_db, runs) -> None:  # type: ignore[no-untyped-def]
    with migrated_db.begin() as s:
        findings = doctor.diagnose(s, runs["healthy"])
    assert [f.check for f in findings] == [c.__name__.removeprefix("check_") for c in doctor.CHECKS]
    assert statuses(findings) == {f.check: "ok" for f in findings}, findings
    assert doctor.doctor_exit_code(findings) == 0


@pytest.mark.parametrize("pathology", sorted(PATHOLOGIES))
def test_doctor_names_exactly_the_problem(migrated_db, runs, pathology: str) -> None:  # type: ignore[no-untyped-def]
    with migrated_db.begin() as s:
        findings = doctor.diagnose(s, runs[pathology])
    problems = [f for f in findings if f.status == "problem"]
    assert [f.check for f in problems] == [PATHOLOGIES[pathology][1]], statuses(findings)
    assert problems[0].remedy and problems[0].evidence
    assert doctor.doctor_exit_code(findings) == 1


def test_starvation_is_attributed_to_the_slow_grader(migrated_db, runs) -> None:  # type: ignore[no-untyped-def]
    with migrated_db.begin() as s:
        findings = {f.check: f for f in doctor.diagnose(s, runs["slow-grader"])}
    buffer = findings[doctor.BUFFER_DEPTH]
    assert (buffer.status, buffer.symptom) == ("warn", "starved")
    assert doctor.GRADER_SHARE in buffer.verdict
    assert findings[doctor.GRADER_SHARE].evidence["grader_share"] >= doctor.GRADER_SHARE_PROBLEM


def test_long_sync_interval_blames_the_interval(migrated_db, runs) -> None:  # type: ignore[no-untyped-def]
    with migrated_db.begin() as s:
        staleness = {f.check: f for f in doctor.diagnose(s, runs["long-sync-interval"])}[doctor.STALENESS]
    assert staleness.symptom == "sync_interval"
    assert "sync.interval" in staleness.remedy
    assert staleness.evidence["max_steps"] == LONG_SYNC_INTERVAL.max_staleness


# -- metrics from Postgres --------------------------------------------------------------------------
def test_gauges_refresh_from_postgres(migrated_db, runs) -> None:  # type: ignore[no-untyped-def]
    metrics = PipelineMetrics(CollectorRegistry())
    with migrated_db.begin() as s:
        metrics.refresh_from_db(s)
    gauge = metrics.registry.get_sample_value
    assert gauge("rlpipe_grader_time_share", {"run": runs["slow-grader"]}) >= doctor.GRADER_SHARE_PROBLEM
    assert gauge("rlpipe_grader_time_share", {"run": runs["healthy"]}) < doctor.GRADER_SHARE_WARN
    assert gauge("rlpipe_sync_wall_share", {"run": runs["costly-sync"]}) >= doctor.SYNC_SHARE_PROBLEM
    assert gauge("rlpipe_sync_paused_share", {"run": runs["costly-sync"]}) >= doctor.SYNC_SHARE_PROBLEM
    assert gauge("rlpipe_buffer_groups", {"run": runs["healthy"]}) == 0  # every group was consumed
    assert gauge("rlpipe_server_version_lag", {"run": runs["healthy"], "server": "1"}) == 0
    assert gauge("rlpipe_server_version_lag", {"run": runs["rejected-sync"], "server": "1"}) == 0  # v8 fixed it


# -- queries on hand-made data ----------------------------------------------------------------------
def test_busy_time_merges_overlapping_spans(migrated_db) -> None:  # type: ignore[no-untyped-def]
    """grader spans [0,10] [5,15] [15,16] [20,25] -> busy 21 s of a 30 s run; trainer [0,30] -> 30 s."""
    name = f"obs-spans-{uuid.uuid4().hex[:8]}"
    spans = [("grader", 0, 10), ("grader", 5, 15), ("grader", 15, 16), ("grader", 20, 25), ("trainer", 0, 30)]
    with migrated_db.begin() as s:
        insert_run(s, name, HEALTHY)
        s.execute(sa.insert(ActivitySpan), [
            {"run_id": name, "box": box, "activity": "a", "workflow_id": name, "activity_id": str(i), "attempt": 1,
             "worker": "h:1", "ok": True, "started_at": at(t0), "finished_at": at(t1)}
            for i, (box, t0, t1) in enumerate(spans)])
        usage = q.box_usage(s, name)
        segments = [(x.box, (x.start - T0).total_seconds(), (x.end - T0).total_seconds()) for x in q.timeline(s, name)]
        share = q.grader_time_share(s, name)
    assert usage["grader"].busy_s == pytest.approx(21.0)
    assert usage["grader"].idle_fraction == pytest.approx(9 / 30)
    assert usage["trainer"].busy_fraction == pytest.approx(1.0)
    assert segments == [("grader", 0, 16), ("grader", 20, 25), ("trainer", 0, 30)]
    assert share == pytest.approx(21 / 51)


def test_buffer_depth_counts_completed_unconsumed_groups(migrated_db) -> None:  # type: ignore[no-untyped-def]
    """Groups complete at 1, 2, 3; step 1 (starting at 4) claims two; the third waits forever."""
    name = f"obs-buffer-{uuid.uuid4().hex[:8]}"
    with migrated_db.begin() as s:
        insert_run(s, name, HEALTHY)
        s.execute(sa.insert(PolicyVersion).values(run_id=name, version=0, trained_steps=0, checkpoint_key="k",
                                                  sha256=sha(name), size_bytes=1))
        s.execute(sa.insert(RolloutGroup), [
            {"run_id": name, "group_index": i, "prompt_index": i, "task_id": "t", "workflow_id": f"{name}-{i}",
             "status": "completed", "n_samples": 2, "n_completed": 2, "min_version": 0, "claimed_step": claimed,
             "started_at": at(0), "completed_at": at(i + 1), "consumed_at": at(9) if claimed else None}
            for i, claimed in enumerate([1, 1, None])])
        s.execute(sa.insert(TrainStep).values(run_id=name, step=1, policy_version=0, n_groups=2, n_trajectories=4,
                                              n_tokens=10, started_at=at(4), finished_at=at(9)))
        depth = [((p.at - T0).total_seconds(), p.groups) for p in q.buffer_depth(s, name)]
        now = q.current_buffer(s, name)
    assert depth == [(1, 1), (2, 2), (3, 3), (4, 1)]  # claimed groups leave when their step starts, not at commit
    assert q.depth_before([q.DepthPoint(at(t), n) for t, n in depth], at(4)) == 3  # the step saw all three
    assert (now.fresh_groups, now.stale_groups) == (1, 0)


def insert_run_with_step_bounds(s: Session, name: str, bound_at_step_4: int | None) -> None:
    """A run configured with max_staleness 2 whose steps 1-3 train on fresh data (staleness 0)
    and whose step 4 trains on data of version 0: 3 steps stale. Steps 1-3 recorded bound 2;
    step 4 recorded `bound_at_step_4` (3: raised by `rlpipe run schedule --max-staleness 3`
    before it; None: committed before the bound was recorded)."""
    insert_run(s, name, replace(HEALTHY, max_staleness=2, steps=4, groups_per_step=1, group_size=2))
    for version in range(4):  # every step published: version v has v trained steps
        s.execute(sa.insert(PolicyVersion).values(run_id=name, version=version, trained_steps=version,
                                                  checkpoint_key=f"{name}/v{version}", sha256=sha(f"{name}{version}"),
                                                  size_bytes=1))
    generated_by = {1: 0, 2: 1, 3: 2, 4: 0}  # step -> version of the data it claimed
    group_ids = insert_returning_ids(s, RolloutGroup, [
        {"run_id": name, "group_index": step - 1, "prompt_index": step - 1, "task_id": "t",
         "workflow_id": f"{name}-{step}", "status": "completed", "n_samples": 2, "n_completed": 2,
         "min_version": version, "max_version": version, "claimed_step": step, "started_at": at(step),
         "completed_at": at(step + 0.5), "consumed_at": at(step + 1)} for step, version in generated_by.items()])
    s.execute(sa.insert(Trajectory), [
        {"run_id": name, "group_id": group_id, "sample_index": i, "status": "completed", "prompt_ids": [1],
         "completion_ids": [2, 3], "loss_mask": [1, 1], "sampler_logprobs": [-0.5, -0.5], "policy_version": version,
         "n_turns": 1, "finish_reason": "stop", "reward": float(i)}
        for group_id, version in zip(group_ids, generated_by.values(), strict=True) for i in range(2)])
    s.execute(sa.insert(TrainStep), [
        {"run_id": name, "step": step, "policy_version": step - 1, "published_version": step, "n_groups": 1,
         "n_trajectories": 2, "n_tokens": 4, "staleness_max": (step - 1) - version,
         "max_staleness": bound_at_step_4 if step == 4 else 2, "started_at": at(step + 0.5),
         "finished_at": at(step + 1)} for step, version in generated_by.items()])


@pytest.mark.parametrize(("bound_at_step_4", "within"), [(3, True), (2, False), (None, False)],
                         ids=["raised-to-3", "recorded-2", "unrecorded-configured-2"])
def test_staleness_is_judged_by_the_bound_of_the_consuming_step(  # type: ignore[no-untyped-def]
        migrated_db, bound_at_step_4: int | None, within: bool) -> None:
    """Data 3 steps stale is within the bound of a step that claimed under max_staleness 3 (raised
    mid-run), and over it when the step's bound is 2, recorded or (unrecorded) the configured one:
    for the audit invariant and for the doctor alike."""
    name = f"obs-bounds-{uuid.uuid4().hex[:8]}"
    with migrated_db.begin() as s:
        insert_run_with_step_bounds(s, name, bound_at_step_4)
        lag = [tuple(r) for r in s.execute(sa.text("select step, staleness, max_staleness from v_version_lag "
                                                   "where run_id = :r order by step"), {"r": name})]
        audit = invariants.within_staleness(s, q.run_info(s, name))
        found = {f.check: f for f in doctor.diagnose(s, name)}[doctor.STALENESS]
    assert lag == [(1, 0, 2)] * 2 + [(2, 0, 2)] * 2 + [(3, 0, 2)] * 2 + [(4, 3, bound_at_step_4)] * 2
    assert audit.ok is within, audit
    if within:
        assert audit.expected == "staleness <= the consuming step's max_staleness: 2 (steps 1-3), 3 (step 4)"
        assert audit.observed == "max 3, none over its step's bound"
        assert found.status == "ok", found
        assert found.evidence["max_staleness"] == "2 (steps 1-3), 3 (step 4)"
        assert found.verdict.endswith("max 3 (bounds 2 (steps 1-3), 3 (step 4))")
    else:
        assert audit.expected == "staleness <= the consuming step's max_staleness: 2"
        assert audit.observed == ("2 trajectories over their step's bound in 1 step(s); worst: step 4 trained on "
                                  "data 3 steps stale under bound 2 (1 over)")
        assert (found.status, found.evidence["max_staleness"], found.evidence["worst_step"]) == ("problem", 2, 4)
        assert "above the max_staleness 2 it claimed under" in found.verdict
        assert "not enforced" in found.verdict


# -- the report -------------------------------------------------------------------------------------
def test_report_of_a_healthy_run(migrated_db, runs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with migrated_db.begin() as s:
        report = write_report(s, runs["healthy"], tmp_path)
    expected = ["reward.png", "response_length.png", "entropy.png", "kl.png", "staleness.png", "buffer_depth.png",
                "idle.png", "sync.png", "eval_accuracy.png", "timeline.png"]
    for png in expected:
        data = (tmp_path / png).read_bytes()
        assert data.startswith(PNG_SIGNATURE), png
        assert len(data) > 5_000, f"{png} is suspiciously small ({len(data)} bytes)"
    text = report.read_text()
    assert report.name == "report.md" and runs["healthy"] in text
    assert all(f"]({png})" in text for png in expected)
    assert "skipped" not in text
    assert (tmp_path / "report.html").read_text().count("data:image/png;base64,") == len(expected)


def test_report_of_an_empty_run_skips_every_plot(migrated_db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    name = f"obs-empty-{uuid.uuid4().hex[:8]}"
    with migrated_db.begin() as s:
        insert_run(s, name, HEALTHY)
        report = write_report(s, name, tmp_path)
    text = report.read_text()
    assert not list(tmp_path.glob("*.png"))
    assert text.count("_skipped: ") == 10
