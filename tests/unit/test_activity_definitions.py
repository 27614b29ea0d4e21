"""The activity definitions the workflows call by (activities/definitions.py) match what the real
implementations and the workflow-logic fakes register: same names, the same payload in and out."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from temporalio import activity

from rlpipe.activities.bookkeeping import BookkeepingActivities
from rlpipe.activities.definitions import ALL_ACTIVITIES, ActivityDefinition
from rlpipe.activities.evaluation import EvaluationActivities
from rlpipe.activities.grading import GradingActivities
from rlpipe.activities.rollout import RolloutActivities
from rlpipe.activities.sync import SyncActivities
from rlpipe.activities.tools import ToolActivities
from rlpipe.activities.training import TrainingActivities
from tests.workflows.fakes import FakeBooks

IMPLEMENTATIONS = (BookkeepingActivities, RolloutActivities, ToolActivities, GradingActivities, EvaluationActivities,
                   TrainingActivities, SyncActivities)


def registered_name(fn: Callable[..., Any]) -> str | None:
    # temporalio keeps what @activity.defn declared on the function; it has no public accessor
    definition = activity._Definition.from_callable(fn)  # noqa: SLF001
    return definition.name if definition else None


def by_name(functions: list[Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    named = {registered_name(fn): fn for fn in functions}
    return {name: fn for name, fn in named.items() if name is not None}


def assert_matches(definition: ActivityDefinition[Any, Any], fn: Callable[..., Any]) -> None:
    signature = inspect.signature(fn, eval_str=True)
    payload = list(signature.parameters.values())[-1]
    assert payload.annotation is definition.input, f"{definition.name} takes {payload.annotation}"
    assert signature.return_annotation is definition.output, f"{definition.name} returns {signature.return_annotation}"


def test_every_definition_has_one_real_implementation_of_its_types() -> None:
    real = by_name([fn for cls in IMPLEMENTATIONS for fn in vars(cls).values() if callable(fn)])
    assert set(real) == {d.name for d in ALL_ACTIVITIES}
    for definition in ALL_ACTIVITIES:
        assert_matches(definition, real[definition.name])


def test_the_fakes_register_every_definition_with_its_types() -> None:
    fakes = by_name(FakeBooks().activities())
    assert set(fakes) == {d.name for d in ALL_ACTIVITIES}
    for definition in ALL_ACTIVITIES:
        assert_matches(definition, fakes[definition.name])


def test_names_are_unique() -> None:
    assert len({d.name for d in ALL_ACTIVITIES}) == len(ALL_ACTIVITIES)
