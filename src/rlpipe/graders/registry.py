"""Grader names -> classes, and the graders a run uses (its config's choice or the env's rubric)."""

from rlpipe.envs.base import Rubric
from rlpipe.graders.base import Grader, GraderDeps
from rlpipe.graders.judge import JudgeGrader
from rlpipe.graders.rules import AnswerMatchGrader, CodeTestsGrader, FinalNumberGrader
from rlpipe.registry import Registry
from rlpipe.schemas.task import GraderConfig


class UnknownGrader(ValueError):
    """A grader name that nobody registered."""


GRADERS: Registry[Grader] = Registry(
    "grader", UnknownGrader, (AnswerMatchGrader, FinalNumberGrader, CodeTestsGrader, JudgeGrader))
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
