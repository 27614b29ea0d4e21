"""Environment names -> classes: rlpipe's own, and plugins named by import path or declared by installed
packages in entry-point group `rlpipe.environments` (rlpipe.registry resolves those in every process).
`register_environment` adds one in the calling process only (tests, notebooks)."""

from collections.abc import Collection, Mapping

from rlpipe.envs.arithmetic import ArithmeticEnv, PlainArithmeticEnv
from rlpipe.envs.base import Environment, Rubric
from rlpipe.envs.calculator import CalculatorEnv
from rlpipe.envs.code import CodeEnv
from rlpipe.envs.dataset import DatasetEnv
from rlpipe.envs.verifiers_env import VerifiersEnv
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


ENVIRONMENT_GROUP = "rlpipe.environments"
"""The entry-point group in which installed packages declare environments."""


def environment_class(kind: str, name: str, found: object) -> type[Environment]:
    """What a plugin name loads, as an Environment class (the place where an adapter of other
    environment libraries would wrap theirs)."""
    if not isinstance(found, type) or not issubclass(found, Environment):
        what = found.__qualname__ if isinstance(found, type) else repr(found)
        raise TypeError(f"environment {name!r} names {what}, which is not a subclass of "
                        "rlpipe.envs.base.Environment: name an Environment class")
    return found

ENVIRONMENTS: Registry[Environment] = Registry(
    "environment", UnknownEnvironment, (ArithmeticEnv, PlainArithmeticEnv, CalculatorEnv, CodeEnv, DatasetEnv,
                    VerifiersEnv),
    check=check_environment_class, uses=graders_used, group=ENVIRONMENT_GROUP, adapt=environment_class)
register_environment = ENVIRONMENTS.register


def build_environment(config: EnvConfig) -> Environment:
    """The environment `config` names, ready to hand out tasks."""
    return ENVIRONMENTS.get(config.name)(config)
