"""The performance targets as one machine-readable list, read off the last `make bench` results.

`make bench` ends with `benchmarks.report`, which calls `write_targets()`: it writes
`benchmarks/results/targets.json`, a list of

    {"name", "value", "unit", "goal": {"op", "value"}, "met", "command", "measured_at", "source", "note"}

and BENCHMARKS.md opens with the same list as a table. A target whose benchmark has not measured it
yet has `value: null` and a note that says what is missing; nothing is estimated here.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.async_vs_sync import HEADLINE
from benchmarks.common import RESULTS

TARGETS_JSON = RESULTS / "targets.json"
# the default sync path of benchmarks/weight_sync.py (S3, pause mode "wait")
DEFAULT_SYNC_PATH = "S3, pause 'wait' (default)"
STREAM_SYNC_PATH = "trainer's stream, pause 'wait'"
COMPARE: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le}


@dataclass(frozen=True)
class Target:
    name: str
    value: float | None
    unit: str
    goal: dict[str, Any]          # {"op": ">=" or "<=", "value": number}
    met: bool | None              # None when not measured
    command: str | None
    measured_at: str | None
    source: str                   # where in benchmarks/results the value comes from
    note: str


@dataclass(frozen=True)
class Spec:
    """How one target is read from one benchmark's result file (`read` returns None when absent)."""
    name: str
    benchmark: str
    read: Callable[[dict[str, Any]], float | None]
    unit: str
    op: str
    goal: float
    source: str
    note: str


def median(summary: dict[str, Any] | None) -> float | None:
    return None if summary is None else float(summary["median"])


def dig(d: dict[str, Any], *keys: str) -> Any:
    """d[k0][k1]… or None where any key is missing."""
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def trainer_over_bare(model: str) -> Callable[[dict[str, Any]], float | None]:
    """The publishing step's speed over the bare loop, when the run trained `model` (the model folder's name)."""
    def read(d: dict[str, Any]) -> float | None:
        return median(d.get("trainer_over_bare")) if Path(d.get("model", "")).name == model else None
    return read


def overhead_fraction(d: dict[str, Any]) -> float | None:
    pct = median(dig(d, "cases", "1.0", "temporal", "overhead_pct"))
    return None if pct is None else pct / 100


SPECS: list[Spec] = [
    Spec("async_speedup", "async_vs_sync", lambda d: median(dig(d, "results", "settings", HEADLINE, "speedup")),
         "x", ">=", 3.0, f"async_vs_sync.json results.settings[{HEADLINE}].speedup",
         "sync wall / async wall of paired runs, default config (max_staleness 1), lognormal tool latency σ=1"),
    Spec("pipeline_efficiency", "async_vs_sync",
         lambda d: median(dig(d, "results", "headline_variants", "async", "efficiency")),
         "fraction of bound", ">=", 0.9, "async_vs_sync.json results.headline_variants.async.efficiency",
         f"achieved samples/s over the slower of trainer and rollout capacity alone, default budget, {HEADLINE}"),
    Spec("temporal_overhead_1s", "orchestration", overhead_fraction, "fraction", "<=", 0.05,
         "orchestration.json cases[1.0].temporal.overhead_pct / 100",
         "added wall per 1-s trajectory (2 activities) through the stack's Temporal dev server vs bare asyncio"),
    Spec("sync_over_copy_smollm2", "weight_sync",
         lambda d: median(dig(d, "server", "paths", DEFAULT_SYNC_PATH, "end_to_end_over_fastest_copy")),
         "x", "<=", 1.5, f"weight_sync.json server.paths[{DEFAULT_SYNC_PATH}].end_to_end_over_fastest_copy",
         "publish → verified on a real vLLM server over the fastest copy of the same bytes"),
    Spec("sync_over_copy_smollm2_stream", "weight_sync",
         lambda d: median(dig(d, "server", "paths", STREAM_SYNC_PATH, "end_to_end_over_fastest_copy")),
         "x", "<=", 1.5, f"weight_sync.json server.paths[{STREAM_SYNC_PATH}].end_to_end_over_fastest_copy",
         "the same through the hot path: the server's vLLM weight-transfer engine pulls from the trainer"),
    Spec("trainer_step_over_bare_smollm2", "trainer_efficiency_smollm2", trainer_over_bare("smollm2"),
         "fraction", ">=", 0.9, "trainer_efficiency_smollm2.json trainer_over_bare",
         "a publishing train step over the bare PyTorch loop on the same batch, SmolLM2-135M fp32"),
    Spec("trainer_step_over_bare_tiny", "trainer_efficiency", trainer_over_bare("tiny"),
         "fraction", ">=", 0.9, "trainer_efficiency.json trainer_over_bare",
         "a publishing train step over the bare PyTorch loop on the same batch, tiny model"),
    Spec("time_to_accuracy_vs_trl", "trl_grpo", lambda d: median(dig(d, "results", "race", "tool", "wall_ratio")),
         "x", "<=", 0.5, "trl_grpo.json results.race.tool.wall_ratio",
         "rlpipe wall / TRL wall to TRL's final held-out accuracy on the multi-turn tool task; "
         "benchmarks/trl_grpo.py does not run this race yet (it compares seconds per step)"),
    Spec("time_to_accuracy_vs_trl_demo", "trl_grpo", lambda d: median(dig(d, "results", "race", "demo", "wall_ratio")),
         "x", "<=", 1.0, "trl_grpo.json results.race.demo.wall_ratio",
         "rlpipe wall / TRL wall to the same held-out accuracy on the demo's task; "
         "benchmarks/trl_grpo.py does not run this race yet (it compares seconds per step)"),
]


def load_results() -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in RESULTS.glob("*.json") if path != TARGETS_JSON}


def evaluate(spec: Spec, results: dict[str, dict[str, Any]]) -> Target:
    d = results.get(spec.benchmark)
    value = spec.read(d) if d is not None else None
    note = spec.note if d is not None else f"{spec.note}; benchmarks/results/{spec.benchmark}.json is missing"
    return Target(name=spec.name, value=value, unit=spec.unit, goal={"op": spec.op, "value": spec.goal},
                  met=None if value is None else COMPARE[spec.op](value, spec.goal),
                  command=d["command"] if d else None, measured_at=d["finished_at"] if d else None,
                  source=spec.source, note=note)


def targets(results: dict[str, dict[str, Any]]) -> list[Target]:
    return [evaluate(spec, results) for spec in SPECS]


def write_targets() -> list[Target]:
    found = targets(load_results())
    TARGETS_JSON.write_text(json.dumps([asdict(t) for t in found], indent=2) + "\n")
    return found


def targets_table(found: list[Target]) -> str:
    """The targets as a markdown table for BENCHMARKS.md."""
    def cell(t: Target) -> str:
        return "not measured" if t.value is None else f"{t.value:.3g} {t.unit}"
    verdict = {True: "met", False: "missed", None: "–"}
    rows = [f"| `{t.name}` | {cell(t)} | {t.goal['op']} {t.goal['value']:g} | {verdict[t.met]} | {t.note} |"
            for t in found]
    return "\n".join(["| target | value | goal | | what |", "|---|---|---|---|---|", *rows])
