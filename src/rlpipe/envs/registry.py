"""Environment names -> classes. Add your own with `register_environment` before configs are validated."""

from collections.abc import Collection, Mapping

from rlpipe.envs.arithmetic import ArithmeticEnv, PlainArithmeticEnv
from rlpipe.envs.base import Environment, Rubric
from rlpipe.envs.calculator import CalculatorEnv
from rlpipe.envs.code import CodeEnv
from rlpipe.registry import Registry, registered_names
from rlpipe.schemas.task import EnvConfig


class UnknownEnvironment(ValueError):
    """An environment name that nobody registered."""


def check_environment_class(cls: type[Environment]) -> None:
    """Refuse an environment without a system prompt or a rubric: it would otherwise register and
    fail only when a worker first frames a prompt or grades a reply."""
    if not isinstance(getattr(cls, "system_prompt", None), str):
        raise TypeError(f"environment {cls.name!r} (class {cls.__qualname__}) has no system_prompt: "
                        "set the class attribute `system_prompt = \"...\"`")
    rubric = getattr(cls, "rubric", None)
    if not isinstance(rubric, Rubric):
        graders = registered_names("grader")
        known = f" (known graders: {', '.join(graders)})" if graders else ""
        found = "none" if rubric is None else f"a {type(rubric).__name__}"
        raise TypeError(f"environment {cls.name!r} (class {cls.__qualname__}) needs a rubric, found {found}: set "
                        f"the class attribute `rubric = Rubric({{grader name: weight}})`{known}")


def graders_used(cls: type[Environment]) -> Mapping[str, Collection[str]]:
    """The graders an environment's rubric names, checked when a run config is validated."""
    return {"grader": tuple(cls.rubric.weights)}


ENVIRONMENTS: Registry[Environment] = Registry(
    "environment", UnknownEnvironment, (ArithmeticEnv, PlainArithmeticEnv, CalculatorEnv, CodeEnv),
    check=check_environment_class, uses=graders_used)
register_environment = ENVIRONMENTS.register


def build_environment(config: EnvConfig) -> Environment:
    """The environment `config` names, ready to hand out tasks."""
    return ENVIRONMENTS.get(config.name)(config)
