"""RunConfig: defaults that work, bad values rejected with the field named, the reference page
generated from the models kept in step with them."""

from __future__ import annotations

from pathlib import Path

import pytest

# a config's env.name and grader.name are checked against the registries loaded in the process
import rlpipe.envs.registry  # noqa: F401
import rlpipe.graders.registry  # noqa: F401
from rlpipe.schemas.config import ConfigError, RunConfig, load_run_config, parse_run_config
from rlpipe.schemas.reference import render

REPO = Path(__file__).resolve().parents[2]


def test_defaults_validate_and_round_trip_through_json() -> None:
    config = RunConfig()
    assert RunConfig.model_validate(config.model_dump(mode="json")) == config
    assert config.staleness == 1 and RunConfig(mode="sync").staleness == 0


@pytest.mark.parametrize(("data", "names"), [
    ({"rollout": {"group_sise": 4}}, "rollout.group_sise"),
    ({"steps": 0}, "steps"),
    ({"mode": "turbo"}, "mode"),
    ({"name": "Bad Name"}, "name"),
    ({"loss": {"clip_low": 1.5}}, "loss.clip_low"),
    ({"env": {"name": "chess"}}, "env.name"),
    ({"grader": {"name": "oracle"}}, "grader.name"),
    ({"mode": "sync", "max_staleness": 2}, "max_staleness"),
    ({"sync": {"interval": 5}}, "sync.interval"),
    ({"rollout": {"groups_per_step": 3}, "batch": {"world_size": 2}}, "groups_per_step"),
    ({"loss": {"temperature": 0.7}}, "temperature"),
    ({"rollout": {"tool_latency": {"kind": "weird"}}}, "rollout.tool_latency"),
    ({"sampling": {"top_p": 0}}, "sampling.top_p"),
])
def test_bad_config_is_rejected_naming_the_field(data: dict, names: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        parse_run_config(data)


def test_toml_errors_name_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "run.toml"
    broken.write_text("steps = [\n")
    with pytest.raises(ConfigError, match="run.toml: not valid TOML"):
        load_run_config(broken)
    with pytest.raises(ConfigError, match="no such config file"):
        load_run_config(tmp_path / "missing.toml")


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path: Path) -> None:
    assert load_run_config(path).name


def test_configuration_reference_is_current() -> None:
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == render(), \
        "docs/configuration.md is stale: run `python -m rlpipe.schemas.reference > docs/configuration.md`"
