"""Grader names -> classes, and the graders a run uses (its config's choice or the env's rubric)."""

from rlpipe.envs.base import Rubric
from rlpipe.graders.base import Grader, GraderDeps
from rlpipe.graders.judge import JudgeGrader
from rlpipe.graders.rules import AnswerMatchGrader, CodeTestsGrader, FinalNumberGrader
from rlpipe.schemas.task import GraderConfig

_GRADERS: dict[str, type[Grader]] = {
    g.name: g for g in (AnswerMatchGrader, FinalNumberGrader, CodeTestsGrader, JudgeGrader)}


class UnknownGrader(ValueError):
    """A grader name that nobody registered."""


def known_graders() -> tuple[str, ...]:
    return tuple(sorted(_GRADERS))


def register_grader(grader_class: type[Grader]) -> None:
    """Make `grader_class` reachable by its `name`; a second class under a taken name is refused."""
    existing = _GRADERS.get(grader_class.name)
    if existing is not None and existing is not grader_class:
        raise ValueError(f"grader name {grader_class.name!r} is already taken by {existing.__qualname__}")
    _GRADERS[grader_class.name] = grader_class


def grader_class(name: str) -> type[Grader]:
    try:
        return _GRADERS[name]
    except KeyError:
        raise UnknownGrader(f"unknown grader {name!r}; known graders: {', '.join(known_graders())}") from None


def build_grader(name: str, config: GraderConfig, deps: GraderDeps) -> Grader:
    return grader_class(name).from_config(config, deps)


def build_rubric_graders(
    env_rubric: Rubric, config: GraderConfig, deps: GraderDeps
) -> tuple[Rubric, dict[str, Grader]]:
    """The rubric a run grades with and one grader per name in it: the environment's own rubric,
    or only `config.name` (weight 1) when the config names a grader."""
    rubric = env_rubric if config.name is None else Rubric({config.name: 1.0})
    return rubric, {name: build_grader(name, config, deps) for name in rubric.weights}
