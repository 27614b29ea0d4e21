"""RunConfig: defaults that work, bad values rejected with the field named, the reference page
generated from the models kept in step with them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

# a config's env.name and grader.name are checked against the registries loaded in the process
import rlpipe.envs.registry
import rlpipe.graders.registry  # noqa: F401
from rlpipe.cli import main as cli
from rlpipe.envs.arithmetic import ArithmeticEnv
from rlpipe.envs.base import Rubric
from rlpipe.schemas.config import ConfigError, RunConfig, load_run_config, parse_run_config
from rlpipe.schemas.reference import render
from rlpipe.workflows.training_run import _validated

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


MISGRADED = ("env 'misgraded' grades with its rubric (answer_match, answer_mtch), but grader(s) answer_mtch are not "
             "registered (known graders: answer_match, code_tests, final_number, judge, verifiers_rubric)")


@pytest.fixture
def misgraded(monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment whose rubric names a grader nobody registered (a typo), registered for one test."""
    registry = rlpipe.envs.registry.ENVIRONMENTS
    monkeypatch.setattr(registry, "_classes", dict(registry._classes))

    class Misgraded(ArithmeticEnv):
        name = "misgraded"
        rubric = Rubric({"answer_match": 1.0, "answer_mtch": 1.0})

    rlpipe.envs.registry.register_environment(Misgraded)


def test_a_rubric_naming_an_unknown_grader_is_refused_by_validation(misgraded: None) -> None:
    with pytest.raises(ConfigError, match=re.escape(MISGRADED)):
        parse_run_config({"env": {"name": "misgraded"}})
    # a grader named in the config replaces the rubric: nothing is missing then
    assert parse_run_config({"env": {"name": "misgraded"}, "grader": {"name": "answer_match"}}).env.name == "misgraded"


def test_a_rubric_naming_an_unknown_grader_stops_the_cli_before_temporal(
        misgraded: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def no_client() -> None:
        raise AssertionError("a config with an unknown rubric grader reached Temporal")

    monkeypatch.setattr(cli, "_client", no_client)
    config = tmp_path / "run.toml"
    config.write_text('[env]\nname = "misgraded"\n')
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "start", str(config)])
    assert exited.value.code == 2
    assert MISGRADED in " ".join(capsys.readouterr().out.split())  # rich wraps long lines


def test_a_rubric_naming_an_unknown_grader_fails_a_web_ui_run_at_once(misgraded: None) -> None:
    """The Web UI's Start Workflow form hands the workflow a plain dict, validated as the run starts."""
    with pytest.raises(ApplicationError, match=re.escape(MISGRADED)) as failed:
        _validated({"name": "ui-run", "env": {"name": "misgraded"}})
    assert failed.value.type == "ConfigError" and failed.value.non_retryable
