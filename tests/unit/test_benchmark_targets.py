"""benchmarks/targets.py reads each target from its benchmark's result file, judges it against its goal,
and says "not measured" (never a guess) where the file or the field is missing."""

from __future__ import annotations

from typing import Any

from benchmarks.targets import SPECS, Target, targets, targets_table


def summary(value: float) -> dict[str, float]:
    return {"median": value, "min": value, "max": value, "n": 1}


def stamped(**fields: Any) -> dict[str, Any]:
    return {"command": ".venv/bin/python -m benchmarks.x", "finished_at": "2026-12-05T00:00:00+00:00", **fields}


RESULTS: dict[str, dict[str, Any]] = {
    "async_vs_sync": stamped(results={"settings": {"sigma=1.0": {"speedup": summary(3.2)}},
                                      "headline_variants": {"async": {"efficiency": summary(0.61)}}}),
    "orchestration": stamped(cases={"1.0": {"temporal": {"overhead_pct": summary(4.0)}}}),
    "trainer_efficiency": stamped(model="/home/u/.rlpipe/models/tiny", trainer_over_bare=summary(0.17)),
}


def by_name(found: list[Target]) -> dict[str, Target]:
    return {t.name: t for t in found}


def test_every_issue_target_is_listed_once() -> None:
    names = [spec.name for spec in SPECS]
    assert len(names) == len(set(names))
    assert {"async_speedup", "pipeline_efficiency", "temporal_overhead_1s", "sync_over_copy_smollm2",
            "trainer_step_over_bare_smollm2", "time_to_accuracy_vs_trl", "time_to_accuracy_vs_trl_demo"} <= set(names)


def test_values_are_read_and_judged_against_their_goals() -> None:
    found = by_name(targets(RESULTS))
    assert (found["async_speedup"].value, found["async_speedup"].met) == (3.2, True)
    assert (found["pipeline_efficiency"].value, found["pipeline_efficiency"].met) == (0.61, False)
    # overhead is stored in percent, the target is a fraction, and lower is better
    assert (found["temporal_overhead_1s"].value, found["temporal_overhead_1s"].met) == (0.04, True)
    assert found["async_speedup"].command == ".venv/bin/python -m benchmarks.x"
    assert found["async_speedup"].measured_at == "2026-12-05T00:00:00+00:00"


def test_the_trainer_ratio_counts_only_for_the_model_it_names() -> None:
    found = by_name(targets(RESULTS))
    assert found["trainer_step_over_bare_tiny"].value == 0.17
    assert (found["trainer_step_over_bare_smollm2"].value, found["trainer_step_over_bare_smollm2"].met) == (None, None)
    smollm2 = stamped(model="/home/u/.rlpipe/models/smollm2", trainer_over_bare=summary(0.5))
    found = by_name(targets({**RESULTS, "trainer_efficiency_smollm2": smollm2}))
    assert (found["trainer_step_over_bare_smollm2"].value, found["trainer_step_over_bare_smollm2"].met) == (0.5, False)


def test_missing_results_are_not_measured_and_say_which_file() -> None:
    found = by_name(targets(RESULTS))
    sync = found["sync_over_copy_smollm2"]
    assert (sync.value, sync.met, sync.command, sync.measured_at) == (None, None, None, None)
    assert "weight_sync.json is missing" in sync.note
    assert "not measured" in targets_table(list(found.values()))
