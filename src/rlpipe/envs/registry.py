"""Environment names -> classes. Add your own with `register_environment` before configs are validated."""

from rlpipe.envs.arithmetic import ArithmeticEnv, PlainArithmeticEnv
from rlpipe.envs.base import Environment
from rlpipe.envs.calculator import CalculatorEnv
from rlpipe.envs.code import CodeEnv
from rlpipe.registry import Registry
from rlpipe.schemas.task import EnvConfig


class UnknownEnvironment(ValueError):
    """An environment name that nobody registered."""


ENVIRONMENTS: Registry[Environment] = Registry(
    "environment", UnknownEnvironment, (ArithmeticEnv, PlainArithmeticEnv, CalculatorEnv, CodeEnv))
register_environment = ENVIRONMENTS.register


def build_environment(config: EnvConfig) -> Environment:
    """The environment `config` names, ready to hand out tasks."""
    return ENVIRONMENTS.get(config.name)(config)
