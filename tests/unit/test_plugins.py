"""Plugins: environments and graders named by import path or declared by an installed package's entry
point are found in any process without registration; a name that cannot be resolved is refused by the
config's validation with the known names and the import error."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import rlpipe.registry
from rlpipe.cli import main as cli
from rlpipe.envs.base import Task
from rlpipe.envs.registry import ENVIRONMENTS, build_environment
from rlpipe.graders.base import GraderDeps
from rlpipe.graders.registry import GRADERS, build_rubric_graders
from rlpipe.schemas.config import ConfigError, parse_run_config
from rlpipe.schemas.task import EnvConfig, GraderConfig

KNOWN_ENVS = "known environments: arithmetic, arithmetic_plain, calculator, code, dataset, verifiers"
KNOWN_GRADERS = "known graders: answer_match, code_tests, final_number, judge, verifiers_rubric"

ENV_MODULE = '''
import random
from rlpipe.envs.base import Environment, Problem, Rubric

class EchoEnv(Environment):
    name = "echo"
    system_prompt = "Repeat the number."
    rubric = Rubric({"final_number": 1.0})

    def sample_problem(self, rng: random.Random) -> Problem:
        n = rng.randint(0, 99)
        return Problem(question=f"Say {n}.", reference=str(n))

class NotAnEnv:
    name = "not_an_env"
'''

GRADER_MODULE = '''
from rlpipe.graders.base import Grader, GradeResult

def contains_reference(task, response_text):
    return float(task.reference in response_text)

async def always_half(task, response_text):
    return 0.5

class Shouting(Grader):
    name = "shouting"
    version = "1"

    async def score(self, task, response_text):
        return GradeResult(float(response_text.isupper()), {"upper": response_text.isupper()})
'''


@pytest.fixture
def plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for the test's modules and packages; registries and modules restored after."""
    for registry in (ENVIRONMENTS, GRADERS):
        monkeypatch.setattr(registry, "_plugins", {})
        monkeypatch.setattr(registry, "_declared", None)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("plug_"):
            del sys.modules[name]
    for registry in (ENVIRONMENTS, GRADERS):  # forget the test's packages, whatever the test read
        registry._declared = None


def module(root: Path, name: str, source: str) -> None:
    (root / f"{name}.py").write_text(textwrap.dedent(source))


def package(root: Path, dist: str, entry_points: dict[str, dict[str, str]]) -> None:
    """What `pip install` leaves of a package for its entry points: a dist-info with its metadata."""
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in names.items()) + "\n"
        for group, names in entry_points.items()))


def task(reference: str = "42") -> Task:
    return Task(id="t:0:train:0", split="train", index=0, question="Say 42.", reference=reference)


# --- import paths ---------------------------------------------------------------------------------


def test_an_environment_named_by_import_path_is_found_without_registration(plugin_path: Path) -> None:
    module(plugin_path, "plug_echo", ENV_MODULE)
    config = parse_run_config({"env": {"name": "plug_echo:EchoEnv", "eval_size": 3}})
    env = build_environment(config.env)
    assert type(env).__qualname__ == "EchoEnv" and env.task("train", 0).question.startswith("Say ")
    assert ENVIRONMENTS.get("plug_echo:EchoEnv") is type(env)  # resolved once per process


def test_a_reward_function_and_a_grader_class_by_import_path_grade(plugin_path: Path) -> None:
    module(plugin_path, "plug_rewards", GRADER_MODULE)
    for name, text, score in (("plug_rewards:contains_reference", "it is 42", 1.0),
                              ("plug_rewards:always_half", "whatever", 0.5),
                              ("plug_rewards:Shouting", "FORTY-TWO", 1.0)):
        config = parse_run_config({"grader": {"name": name}})
        rubric, graders = build_rubric_graders(build_environment(config.env).rubric, config.grader, GraderDeps())
        assert list(rubric.weights) == [name]
        assert asyncio.run(graders[name].grade(task(), text)).score == score


def test_a_reward_functions_version_follows_its_source(plugin_path: Path) -> None:
    """Cached grades are keyed on (grader, version): an edited function must not get its old verdicts."""
    module(plugin_path, "plug_rewards", GRADER_MODULE)
    first = GRADERS.get("plug_rewards:contains_reference").version
    module(plugin_path, "plug_rewards2", GRADER_MODULE.replace("task.reference in", "task.reference not in"))
    assert GRADERS.get("plug_rewards2:contains_reference").version != first


@pytest.mark.parametrize(("section", "name", "message"), [
    ("env", "plug_missing.tasks:Env",
     "env.name 'plug_missing.tasks:Env' is not a registered environment: environment 'plug_missing.tasks:Env' "
     "cannot be loaded: cannot import 'plug_missing.tasks' for 'plug_missing.tasks:Env': ModuleNotFoundError: No "
     f"module named 'plug_missing' ({KNOWN_ENVS})"),
    ("env", "plug_echo:Echo",
     "environment 'plug_echo:Echo' cannot be loaded: module 'plug_echo' has no attribute 'Echo' (for "
     f"'plug_echo:Echo') ({KNOWN_ENVS})"),
    ("env", "plug_echo:NotAnEnv",
     "environment 'plug_echo:NotAnEnv' names NotAnEnv, which is not a subclass of rlpipe.envs.base.Environment"),
    ("env", "plug echo:EchoEnv",
     "environment 'plug echo:EchoEnv' is not an import path: write it as 'package.module:Class'"),
    ("env", "plug_broken:Env",
     "cannot import 'plug_broken' for 'plug_broken:Env': RuntimeError: needs a GPU"),
    ("grader", "plug_echo:EchoEnv",
     "grader.name 'plug_echo:EchoEnv' is not a registered grader: grader 'plug_echo:EchoEnv' names class EchoEnv, "
     "which is not a rlpipe.graders.base.Grader"),
    ("grader", "plug_rewards:nothing",
     f"module 'plug_rewards' has no attribute 'nothing' (for 'plug_rewards:nothing') ({KNOWN_GRADERS})"),
], ids=["no-module", "no-attribute", "not-an-environment", "malformed", "import-fails", "not-a-grader",
        "no-function"])
def test_an_unresolvable_import_path_fails_validation_with_the_reason(
        plugin_path: Path, section: str, name: str, message: str) -> None:
    module(plugin_path, "plug_echo", ENV_MODULE)
    module(plugin_path, "plug_rewards", GRADER_MODULE)
    module(plugin_path, "plug_broken", "raise RuntimeError('needs a GPU')\n")
    with pytest.raises(ConfigError) as caught:
        parse_run_config({section: {"name": name}})
    assert f"config: {section}" in str(caught.value) and message in str(caught.value)


# --- entry points ---------------------------------------------------------------------------------


def test_an_installed_packages_entry_points_are_found_and_listed(
        plugin_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    module(plugin_path, "plug_echo", ENV_MODULE.replace('"final_number"', '"shouting"'))
    module(plugin_path, "plug_rewards", GRADER_MODULE)
    package(plugin_path, "plug-tasks", {"rlpipe.environments": {"echo": "plug_echo:EchoEnv"},
                                        "rlpipe.graders": {"shouting": "plug_rewards:Shouting"}})
    assert "plug_echo" not in sys.modules  # declaring reads metadata only
    config = parse_run_config({"env": {"name": "echo", "eval_size": 2}})  # its rubric names the package's grader
    rubric, graders = build_rubric_graders(build_environment(config.env).rubric, config.grader, GraderDeps())
    assert asyncio.run(graders["shouting"].grade(task(), "HI")).score == 1.0
    monkeypatch.setenv("COLUMNS", "300")
    cli.main(["envs", "list"])
    listed = capsys.readouterr().out
    assert any([cell.strip() for cell in line.split("│")[1:6]] ==
               ["echo", "entry point", "plug_echo:EchoEnv", "plug-tasks 1.0", "ok"] for line in listed.splitlines()), \
        listed
    assert "arithmetic" in listed and "rlpipe.envs.arithmetic:ArithmeticEnv" in listed


def test_a_package_installed_after_the_process_started_is_found(plugin_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"unknown environment 'echo'; {KNOWN_ENVS} "):
        parse_run_config({"env": {"name": "echo"}})
    module(plugin_path, "plug_echo", ENV_MODULE)
    package(plugin_path, "plug-tasks", {"rlpipe.environments": {"echo": "plug_echo:EchoEnv"}})
    assert parse_run_config({"env": {"name": "echo"}}).env.name == "echo"


@pytest.mark.parametrize(("entry_points", "message"), [
    ({"rlpipe.environments": {"echo": "plug_gone:EchoEnv"}},
     "entry point 'echo' of package plug-tasks 1.0 (group 'rlpipe.environments', plug_gone:EchoEnv) cannot be "
     "loaded: ModuleNotFoundError: No module named 'plug_gone'"),
    ({"rlpipe.environments": {"echoes": "plug_echo:EchoEnv"}},
     "entry point 'echoes' loads environment class EchoEnv, whose name is 'echo': give the entry point and the "
     "class the same name"),
], ids=["broken-entry-point", "name-mismatch"])
def test_a_broken_entry_point_names_its_package(
        plugin_path: Path, entry_points: dict[str, dict[str, str]], message: str) -> None:
    module(plugin_path, "plug_echo", ENV_MODULE)
    package(plugin_path, "plug-tasks", entry_points)
    name = next(iter(entry_points["rlpipe.environments"]))
    with pytest.raises(ConfigError) as caught:
        parse_run_config({"env": {"name": name}})
    assert message in str(caught.value)


def test_a_name_two_packages_declare_is_refused(plugin_path: Path) -> None:
    module(plugin_path, "plug_echo", ENV_MODULE)
    package(plugin_path, "plug-tasks", {"rlpipe.environments": {"echo": "plug_echo:EchoEnv"}})
    package(plugin_path, "plug-other", {"rlpipe.environments": {"echo": "plug_other:EchoEnv"}})
    with pytest.raises(ConfigError, match=r"environment 'echo' is declared by several packages \(plug-.* 1\.0: "
                                          r"plug_.*:EchoEnv; plug-.* 1\.0: plug_.*:EchoEnv\): uninstall all but one"):
        parse_run_config({"env": {"name": "echo"}})


# --- inside a workflow: nothing is imported -------------------------------------------------------


def test_inside_a_workflow_plugins_are_checked_without_importing_them(
        plugin_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workflow worker decodes run configs inside workflow code, which must not run a user's module
    nor read what one worker has installed: an import path is checked for its form, any other unknown
    name is left to the activities, which import them (the CLI refused bad names before the start)."""
    module(plugin_path, "plug_echo", ENV_MODULE)
    package(plugin_path, "plug-tasks", {"rlpipe.environments": {"echo": "plug_echo:EchoEnv"}})
    monkeypatch.setattr(rlpipe.registry, "_in_workflow", lambda: True)
    assert parse_run_config({"env": {"name": "plug_echo:EchoEnv"}}).env.name == "plug_echo:EchoEnv"
    assert parse_run_config({"env": {"name": "echo"}, "grader": {"name": "plug_nowhere:fn"}}).env.name == "echo"
    assert "plug_echo" not in sys.modules and "plug_nowhere" not in sys.modules
    monkeypatch.setattr(rlpipe.registry, "declared", lambda group: pytest.fail(f"read entry points of {group}"))
    assert parse_run_config({"env": {"name": "chess"}}).env.name == "chess"
    with pytest.raises(ConfigError, match="'plug echo:EchoEnv' is not an import path"):
        parse_run_config({"env": {"name": "plug echo:EchoEnv"}})


def test_grader_config_names_are_resolved_like_environments(plugin_path: Path) -> None:
    module(plugin_path, "plug_rewards", GRADER_MODULE)
    assert GraderConfig(name="plug_rewards:contains_reference").name == "plug_rewards:contains_reference"
    with pytest.raises(ValueError, match=f"unknown grader 'bleu'; {KNOWN_GRADERS}"):
        GraderConfig(name="bleu")
    assert EnvConfig(name="arithmetic").name == "arithmetic"


def test_the_reward_function_example_runs() -> None:
    import doctest

    import rlpipe.graders.function

    result = doctest.testmod(rlpipe.graders.function, raise_on_error=False)
    assert result.attempted >= 4 and result.failed == 0, "the example in graders/function.py fails: see the output"
