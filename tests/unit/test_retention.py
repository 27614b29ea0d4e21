"""The retention plan (weights/retention.py) and the restore base (weights/checkpoints.py): pure logic."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlpipe.schemas.config import RetentionConfig, RunConfig
from rlpipe.schemas.tables import PolicyVersion
from rlpipe.weights.checkpoints import recovery_base
from rlpipe.weights.retention import plan_retention


def test_without_keep_last_every_version_is_kept() -> None:
    plan = plan_retention(range(5), RetentionConfig(), {})
    assert plan.delete == [] and list(plan.keep) == [0, 1, 2, 3, 4]


def test_the_newest_the_multiples_and_the_needed_are_kept_with_their_reasons() -> None:
    plan = plan_retention(range(12), RetentionConfig(keep_last=2, keep_every=5),
                          {3: "held by server 1", 10: "a restarted trainer restores from it", 99: "not stored"})
    assert plan.keep == {0: "a multiple of 5", 3: "held by server 1", 5: "a multiple of 5",
                         10: "one of the newest 2", 11: "one of the newest 2"}
    assert plan.delete == [1, 2, 4, 6, 7, 8, 9]


def test_keep_last_counts_the_versions_stored_not_the_numbers() -> None:
    plan = plan_retention([0, 4, 9], RetentionConfig(keep_last=2), {})  # 1-3, 5-8 deleted before
    assert list(plan.keep) == [4, 9] and plan.delete == [0]


def test_keep_every_without_keep_last_is_rejected_naming_both() -> None:
    with pytest.raises(ValidationError, match="keep_every needs keep_last"):
        RunConfig.model_validate({"retention": {"keep_every": 5}})
    with pytest.raises(ValidationError, match="retention.keep_last"):
        RunConfig.model_validate({"retention": {"keep_last": 0}})


def version(number: int, trained_steps: int) -> PolicyVersion:
    return PolicyVersion(run_id="r", version=number, trained_steps=trained_steps, checkpoint_key="k", sha256="0" * 64,
                         size_bytes=1)


VERSIONS = [version(0, 0), version(1, 2), version(2, 4), version(3, 6)]


@pytest.mark.parametrize(("durable", "states", "step", "expected"), [
    ({0, 1, 2, 3}, {4, 6}, 6, 3),     # the newest with its optimizer state
    ({0, 1, 2, 3}, {4, 6}, 5, 2),     # never one trained past the step restored to
    ({0, 1, 2, 3}, {6}, 5, 0),        # no state at or before step 5: the base, with a fresh optimizer
    ({0, 1, 3}, {4, 6}, 5, 0),        # v2's upload never finished: not a base
    ({1, 2, 3}, {2}, 3, 1),           # the base deleted, a later state kept
    ({1, 2, 3}, set(), 3, None),      # nothing to restore from
])
def test_the_restore_base(durable: set[int], states: set[int], step: int, expected: int | None) -> None:
    base = recovery_base(VERSIONS, durable, states, step)
    assert (base.version if base is not None else None) == expected
