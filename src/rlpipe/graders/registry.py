"""Grader names -> classes, and the graders a run uses (its config's choice or the env's rubric).

Besides rlpipe's own, a grader may be named by import path or declared by an installed package in
entry-point group `rlpipe.graders` (rlpipe.registry resolves those in every process); either may name
a Grader class or a plain reward function (graders.function).
"""

from collections.abc import Callable
from typing import Any

from rlpipe.envs.base import Rubric
from rlpipe.graders.base import Grader, GraderDeps
from rlpipe.graders.function import function_grader
from rlpipe.graders.judge import JudgeGrader
from rlpipe.graders.rules import AnswerMatchGrader, CodeTestsGrader, FinalNumberGrader
from rlpipe.graders.verifiers_rubric import VerifiersRubricGrader
from rlpipe.registry import Registry
from rlpipe.schemas.task import GraderConfig


class UnknownGrader(ValueError):
    """A grader name that nobody registered."""


GRADER_GROUP = "rlpipe.graders"
"""The entry-point group in which installed packages declare graders."""


def grader_class(kind: str, name: str, found: object) -> type[Grader]:
    """What a plugin name loads, as a Grader class: a Grader subclass as it is, a function wrapped."""
    if isinstance(found, type):
        if not issubclass(found, Grader):
            raise TypeError(f"grader {name!r} names class {found.__qualname__}, which is not a "
                            "rlpipe.graders.base.Grader: subclass Grader, or name a reward function")
        return found
    if callable(found):
        function: Callable[..., Any] = found
        return function_grader(name, function)
    raise TypeError(f"grader {name!r} names {found!r}: name a Grader class or a function (task, response_text)")


GRADERS: Registry[Grader] = Registry(
    "grader", UnknownGrader, (AnswerMatchGrader, FinalNumberGrader, CodeTestsGrader, JudgeGrader,
                                VerifiersRubricGrader),
    group=GRADER_GROUP, adapt=grader_class)
register_grader = GRADERS.register


def build_grader(name: str, config: GraderConfig, deps: GraderDeps) -> Grader:
    return GRADERS.get(name).from_config(config, deps)


def build_rubric_graders(
    env_rubric: Rubric, config: GraderConfig, deps: GraderDeps
) -> tuple[Rubric, dict[str, Grader]]:
    """The rubric a run grades with and one grader per name in it: the environment's own rubric,
    or only `config.name` (weight 1) when the config names a grader."""
    rubric = env_rubric if config.name is None else Rubric({config.name: 1.0})
    return rubric, {name: build_grader(name, config, deps) for name in rubric.weights}
