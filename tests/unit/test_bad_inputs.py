"""Bad inputs that need no server: the cases of the bad-input table (issue #9) that are pure logic.
The table itself, row by row with the test of each, is in tests/integration/test_bad_inputs.py."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from rlpipe.cli import main as cli
from rlpipe.envs.registry import build_environment
from rlpipe.inference.client import InferenceClient
from rlpipe.rollout.context import checked_model_dir
from rlpipe.rollout.generation import ContextTooLong, TurnPlan, sample_turn
from rlpipe.schemas.config import ConfigError, RunConfig
from rlpipe.schemas.payloads import RunState, ScheduleUpdate
from rlpipe.schemas.task import EnvConfig
from rlpipe.workflows.training_run import TrainingRunWorkflow

GOOD = 'name = "cli-bad"\nsteps = 2\n'


@pytest.mark.parametrize(("toml", "argv", "named"), [
    (None, [], "run.toml: no such config file"),
    ("steps = [\n", [], "run.toml: not valid TOML"),
    (GOOD + "[rollout]\ngroup_sise = 4\n", [], "rollout.group_sise: unknown field"),
    (GOOD + "[sampling]\ntop_p = 1.5\n", [], "sampling.top_p: Input should be less than or equal to 1"),
    (GOOD + "[rollout]\ngroup_size = \"four\"\n", [], "rollout.group_size: Input should be a valid integer"),
    (GOOD + "[env]\nname = \"chess\"\n", [], "env.name 'chess' is not a registered environment"),
    (GOOD + "[grader]\nname = \"oracle\"\n", [], "grader.name 'oracle' is not a registered grader"),
    # the pattern's brackets must reach the terminal: rich markup used to swallow them
    (GOOD, ["--name", "Bad Name"], "name: String should match pattern '^[a-z0-9][a-z0-9_.-]{0,62}$'"),
])
def test_cli_refuses_a_bad_config_before_it_connects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        toml: str | None, argv: list[str], named: str) -> None:
    def no_client() -> None:
        raise AssertionError("a bad config reached Temporal")

    monkeypatch.setattr(cli, "_client", no_client)
    config = tmp_path / "run.toml"
    if toml is not None:
        config.write_text(toml)
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "start", str(config), *argv])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert exited.value.code == 2
    assert named in out and str(config) in out and "Traceback" not in out


def fake_model_dir(root: Path, config: object = {"model_type": "llama"}, weights: bool = True) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights:
        (root / "model.safetensors").write_bytes(b"")
    return root


def test_model_dir_check_names_the_path_and_what_is_missing(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match=rf"model.path '{re.escape(str(missing))}' .*: no such directory"):
        checked_model_dir(str(missing))
    (tmp_path / "a-file").write_text("weights?")
    with pytest.raises(ConfigError, match="a-file.*: no such directory"):
        checked_model_dir(str(tmp_path / "a-file"))
    not_a_model = {"bare": tmp_path / "bare", "junk": fake_model_dir(tmp_path / "junk", "{not json"),
                   "list": fake_model_dir(tmp_path / "list", "[1, 2]"),
                   "untyped": fake_model_dir(tmp_path / "untyped", {"hidden_size": 8})}
    not_a_model["bare"].mkdir()
    for name, path in not_a_model.items():
        with pytest.raises(ConfigError, match=f"{name}.* is not a model directory: no config.json with a model_type"):
            checked_model_dir(str(path))
    with pytest.raises(ConfigError, match="is not a model directory: no \\*.safetensors weights"):
        checked_model_dir(str(fake_model_dir(tmp_path / "no-weights", weights=False)))
    good = fake_model_dir(tmp_path / "good")
    assert checked_model_dir(str(good)) == good.resolve()


async def test_prompt_over_the_configured_context_is_refused_before_any_request() -> None:
    with socket.socket() as sock:  # nobody listens: a request would fail with another error
        sock.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = RunConfig(model={"max_model_len": 512})
    plan = TurnPlan(input_ids=[5] * 600, context_ids=[5] * 600)
    async with InferenceClient(nowhere, "policy") as client:
        with pytest.raises(ContextTooLong, match=r"the context has 600 tokens, the model's limit is 512 "
                                                 r"\(model.max_model_len\)"):
            await sample_turn(client, plan, config, build_environment(EnvConfig()), tokenizer=None, seed=0)


def validators(mode: str = "async", paused: bool = False, step: int = 0) -> TrainingRunWorkflow:
    """The run workflow's update validators read only its config and state: a bare instance is
    enough to check them outside a worker."""
    run = TrainingRunWorkflow.__new__(TrainingRunWorkflow)
    run.config = RunConfig(name="v", mode=mode, steps=4)  # type: ignore[arg-type]
    run.state = RunState(step=step, paused=paused, pause_reason="maintenance" if paused else None,
                         sync_interval=1, max_staleness=run.config.staleness)
    return run


@pytest.mark.parametrize(("run", "update", "message"), [
    (validators(), ScheduleUpdate(sync_interval=0), "sync_interval must be >= 1, got 0"),
    (validators(), ScheduleUpdate(max_staleness=-1), "max_staleness must be >= 0, got -1"),
    (validators(), ScheduleUpdate(sync_interval=5), r"sync_interval \(5\) > max_staleness \+ 1 \(2\)"),
    (validators("sync"), ScheduleUpdate(max_staleness=1), "a sync-mode run keeps sync_interval 1 and max_staleness 0"),
])
def test_schedule_validator_names_the_field(run: TrainingRunWorkflow, update: ScheduleUpdate, message: str) -> None:
    with pytest.raises(ApplicationError, match=message):
        run._validate_schedule(update)
    assert (run.state.sync_interval, run.state.max_staleness) == (1, run.config.staleness)  # nothing applied


def test_pause_and_resume_validators_say_why() -> None:
    with pytest.raises(ApplicationError, match=r"run v is already paused \(maintenance\)"):
        validators(paused=True)._validate_pause(None)  # type: ignore[arg-type]
    with pytest.raises(ApplicationError, match="run v has finished; there is nothing to pause"):
        validators(step=4)._validate_pause(None)  # type: ignore[arg-type]
    with pytest.raises(ApplicationError, match="run v is not paused"):
        validators()._validate_resume()
