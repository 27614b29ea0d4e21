"""`VerifiersConfig`: which installed `verifiers` environment a run trains on, and how its tasks split.

Shapes only: the environment is imported and checked by `envs.verifiers_env` (in the command line before
a run starts, and in every worker that builds it), since the workflow that decodes this config must not
import a user's package.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TASKS = 100_000  # tasks read from a taskset; an infinite one needs max_tasks


class VerifiersConfig(BaseModel):
    """An installed `verifiers` environment (a taskset package) and the arguments it is loaded with."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    id: str = Field(min_length=1)
    """The environment's id as `verifiers` names it: the installed package's module, with '-' for '_'
    ('vf-sums' imports vf_sums); a Hub id 'owner/name@version' loads the installed 'name'."""
    args: dict[str, Any] = Field(default_factory=dict)
    """The taskset's config fields (its TasksetConfig subclass), as `verifiers` takes them from
    --env.taskset.* or TOML: validated by the environment's own config class before the run starts."""
    eval_tasks: int | None = Field(None, ge=0)
    """Tasks carved off for held-out evaluation, by a hash of each task's key and env.seed (the same tasks
    in every process, none also trained on); None: a tenth of the tasks, at least one."""
    max_tasks: int | None = Field(None, ge=2, le=MAX_TASKS)
    """Read at most this many tasks from the taskset, in its order; required for an infinite taskset."""

    @field_validator("args")
    @classmethod
    def _args_are_fields(cls, args: dict[str, Any]) -> dict[str, Any]:
        if "id" in args:
            raise ValueError("env.verifiers.args sets 'id': the environment's id is env.verifiers.id; remove it")
        return args
