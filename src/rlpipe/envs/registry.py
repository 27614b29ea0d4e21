"""Environment names -> classes. Add your own with `register_environment` before configs are validated."""

from rlpipe.envs.arithmetic import ArithmeticEnv, PlainArithmeticEnv
from rlpipe.envs.base import Environment
from rlpipe.envs.calculator import CalculatorEnv
from rlpipe.envs.code import CodeEnv
from rlpipe.schemas.task import EnvConfig

_ENVIRONMENTS: dict[str, type[Environment]] = {
    env.name: env for env in (ArithmeticEnv, PlainArithmeticEnv, CalculatorEnv, CodeEnv)}


class UnknownEnvironment(ValueError):
    """An environment name that nobody registered."""


def known_environments() -> tuple[str, ...]:
    return tuple(sorted(_ENVIRONMENTS))


def register_environment(env_class: type[Environment]) -> None:
    """Make `env_class` reachable by its `name`; a second class under a taken name is refused."""
    existing = _ENVIRONMENTS.get(env_class.name)
    if existing is not None and existing is not env_class:
        raise ValueError(f"environment name {env_class.name!r} is already taken by {existing.__qualname__}")
    _ENVIRONMENTS[env_class.name] = env_class


def environment_class(name: str) -> type[Environment]:
    try:
        return _ENVIRONMENTS[name]
    except KeyError:
        raise UnknownEnvironment(
            f"unknown environment {name!r}; known environments: {', '.join(known_environments())}"
        ) from None


def build_environment(config: EnvConfig) -> Environment:
    """The environment `config` names, ready to hand out tasks."""
    return environment_class(config.name)(config)
