"""The 'verifiers' environment without the stack: the test package's two `verifiers` environments
(tests/plugins/rlpipe_vf_tasks, on sys.path here) become rlpipe tasks, tools and grades; the adapter's
pure parts (tool arguments, the eval carve, the conversation a rubric reads) give hand-computed answers;
and each refused feature, an unknown id and bad settings are refused by name before a run starts."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import rlpipe.graders.registry  # noqa: F401 - the rubric's grader is checked against it
from rlpipe.envs.base import ToolResult
from rlpipe.envs.registry import build_environment
from rlpipe.envs.toolcalls import Final, ToolCalls
from rlpipe.envs.verifiers_env import VerifiersEnv, carve, tool_arguments
from rlpipe.envs.verifiers_load import ToolSpec, VerifiersError, VerifiersFeatureError
from rlpipe.graders.conversation import assistant_message, conversation_text, stored_turn_messages, tool_message
from rlpipe.graders.verifiers_rubric import VerifiersRubricGrader
from rlpipe.schemas.task import EnvConfig
from tests.unit.test_datasets import run_start

PACKAGE = Path(__file__).resolve().parents[1] / "plugins" / "rlpipe_vf_tasks"


@pytest.fixture(autouse=True)
def vf_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PACKAGE))


def vf_env(env_id: str, **settings: Any) -> VerifiersEnv:
    env = build_environment(EnvConfig(name="verifiers", verifiers={"id": env_id, **settings}))
    assert isinstance(env, VerifiersEnv)
    return env


def grade(env: VerifiersEnv, index: int, messages: list[dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    result = asyncio.run(VerifiersRubricGrader().grade(env.task("train", index), conversation_text(messages)))
    return result.score, result.details


def test_a_single_turn_environment_gives_its_prompts_and_its_rubric_grades() -> None:
    env = vf_env("vf-sums", args={"max_operand": 5})  # 36 tasks: the args reach the taskset's config
    assert (env.size("train"), env.size("eval"), env.max_turns, env.tool_specs) == (33, 3, 1, [])
    task = env.task("train", 0)
    a, b = map(int, task.question.removeprefix("What is ").removesuffix("?").split(" + "))
    assert task.reference == f'{{"answer": {a + b}}}'
    assert env.initial_messages(task) == [{"role": "system", "content": "Answer with just the number."},
                                          {"role": "user", "content": task.question}]
    assert isinstance(env.step(task, f"{a + b}"), Final)
    # correct (weight 1) and brief (weight 0.5, 8 / characters beyond 8): the weighted sum over the weights
    assert grade(env, 0, [assistant_message(f"{a + b}", [])])[0] == 1.0
    score, details = grade(env, 0, [assistant_message(f"It is {a + b + 1}, yes sir.", [])])
    assert details["rewards"]["correct"] == {"score": 0.0, "weight": 1.0}
    brief = 8 / len(f"It is {a + b + 1}, yes sir.")
    assert score == pytest.approx(0.5 * brief / 1.5) and details["reward_sum"] == pytest.approx(0.5 * brief)
    assert details["metrics"] == {"reply_chars": float(len(f"It is {a + b + 1}, yes sir."))}


def test_splits_are_disjoint_the_same_in_every_process_and_cover_the_taskset() -> None:
    env = vf_env("vf-sums", eval_tasks=7)
    evals = {env.task("eval", i).question for i in range(env.size("eval"))}
    train = {env.task("train", i).question for i in range(env.size("train"))}
    assert len(evals) == 7 and not evals & train and len(evals | train) == 100
    assert [env.task("train", i).id for i in range(3)] == ["verifiers:0:train:0", "verifiers:0:train:1",
                                                          "verifiers:0:train:2"]
    keys = [f"k{i}" for i in range(10)]
    train_positions, eval_positions = carve(keys, seed=3, eval_count=2)
    assert sorted(train_positions + eval_positions) == list(range(10))
    # the carve follows the keys, not the order the taskset yields them in
    reversed_train, reversed_eval = carve(keys[::-1], seed=3, eval_count=2)
    assert {keys[::-1][i] for i in reversed_eval} == {keys[i] for i in eval_positions}
    assert [keys[::-1][i] for i in reversed_train] == [keys[i] for i in train_positions]


def test_a_tool_environment_calls_its_toolset_and_its_rubric_reads_the_tool_results() -> None:
    env = vf_env("vf-sums-calc")
    assert env.max_turns == 4 and [spec.name for spec in env.tool_specs] == ["calc"]
    task = env.task("train", 0)
    system = env.initial_messages(task)[0]["content"]
    assert "<calc>expression</calc>" in system and "- calc(expression): Compute `a + b`" in system
    action = env.step(task, "Let me see. <calc>3 + 4</calc>")
    assert isinstance(action, ToolCalls) and "</calc>" in env.stop_sequences
    assert asyncio.run(env.run_tool(action.calls[0], executor=None)) == ToolResult(ok=True, output="7")  # type: ignore[arg-type]
    failed = asyncio.run(env.run_tool(env.step(task, "<calc>3 / 4</calc>").calls[0], None))  # type: ignore[union-attr,arg-type]
    assert not failed.ok and failed.reason == "ValueError: write two integers with +, - or * between them"
    answer = int(task.reference.removeprefix('{"answer": ').removesuffix("}"))
    episode = [assistant_message("<calc>3 + 4</calc>", [("calc", "3 + 4")]), tool_message("calc", True, "7", None),
               assistant_message(f"<answer>{answer}</answer>", [])]
    assert grade(env, 0, episode) == (1.0, {"rewards": {"correct": {"score": 1.0, "weight": 1.0},
                                                        "used_tool": {"score": 1.0, "weight": 0.25}},
                                            "reward_sum": 1.25, "metrics": {}})
    assert grade(env, 0, [assistant_message(f"{answer}", [])])[0] == pytest.approx(1 / 1.25)


def test_a_stored_turn_becomes_the_model_message_and_the_tool_results_a_rubric_reads() -> None:
    stored = stored_turn_messages("<calc>2*3</calc>", [
        {"name": "calc", "arguments": "2*3", "error": None,
         "result": {"ok": True, "output": "6", "reason": None, "status": "ok", "latency_s": 0.1}}])
    assert stored == [assistant_message("<calc>2*3</calc>", [("calc", "2*3")]), tool_message("calc", True, "6", None)]
    assert stored_turn_messages("6", None) == [{"role": "assistant", "content": "6"}]


def test_tool_arguments_are_a_json_object_or_the_text_for_one_parameter() -> None:
    add = ToolSpec("add", "", ("a", "b"), ("a",), lambda a, b=0: a + b)
    assert tool_arguments(add, '{"a": 1, "b": 2}') == {"a": 1, "b": 2}
    assert tool_arguments(add, '{"a": 1}') == {"a": 1}
    for text, message in [("1 2", "the arguments of add must be a JSON object with 'a', 'b'"),
                          ('{"b": 2}', "add(a, b) got no ['a']"), ('{"a": 1, "c": 3}', "add(a, b) got unknown "
                                                                                       "arguments ['c']")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            tool_arguments(add, text)
    echo = ToolSpec("echo", "", ("text",), ("text",), str)
    assert tool_arguments(echo, "any text") == {"text": "any text"}


REFUSED = {
    "intercept": ("@vf.intercept hooks", """
        @vf.intercept
        async def rewrite(self, request: vf.Request) -> None:
            return None"""),
    "stop": ("@vf.stop hooks", """
        @vf.stop
        async def enough(self, trace: vf.Trace) -> bool:
            return True"""),
    "runtime": ("rewards or metrics that read a runtime box (in_box)", """
        @vf.reward
        async def in_box(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
            return 1.0"""),
}


TASKSET = """import verifiers.v1 as vf

class OneTask(vf.Task):
    @vf.reward
    async def ok(self, trace: vf.Trace) -> float:
        return 1.0
{task_body}

class Tasks(vf.Taskset[OneTask, vf.TasksetConfig]):
    def load(self):
        for i in range(4):
            yield OneTask(vf.TaskData(prompt=f"Say {{i}}."), self.config.task)
{extra}
__all__ = [{exports}]
"""


def write_taskset(site: Path, module: str, task_body: str, extra: str = "", exports: str = '"Tasks"') -> str:
    """A taskset package `module` in `site` whose one task class has `task_body` added; its verifiers id."""
    (site / module).mkdir()
    body = textwrap.indent(textwrap.dedent(task_body), "    ")
    (site / module / "__init__.py").write_text(TASKSET.format(task_body=body, extra=extra, exports=exports))
    return module.replace("_", "-")


@pytest.mark.parametrize("feature", sorted(REFUSED))
def test_what_cannot_be_played_token_exactly_is_refused_by_name(
        feature: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    named, body = REFUSED[feature]
    env_id = write_taskset(tmp_path, f"vf_refused_{feature}", body)
    with pytest.raises(VerifiersFeatureError, match="uses " + named.replace("(", r"\(").replace(")", r"\)")
                       + ", which rlpipe refuses") as refused:
        vf_env(env_id)
    assert "docs/own-tasks.md" in str(refused.value)


def test_a_bundled_harness_and_a_stateful_toolset_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    harness = write_taskset(tmp_path, "vf_own_harness", "", extra="""
class Loop(vf.Harness[vf.HarnessConfig]):
    pass
""", exports='"Tasks", "Loop"')
    with pytest.raises(VerifiersFeatureError, match=r"a harness of its own \(a program that calls the model itself\)"):
        vf_env(harness)
    stateful = write_taskset(tmp_path, "vf_stateful_tools", """
        @classmethod
        def toolsets(cls, config):
            return [Counter(vf.ToolsetConfig())]""", extra="""
class CounterState(vf.State):
    count: int = 0

class Counter(vf.Toolset[vf.ToolsetConfig, CounterState]):
    @vf.tool
    async def bump(self) -> int:
        self.state.count += 1
        return self.state.count
""")
    with pytest.raises(VerifiersFeatureError, match=r"a stateful toolset \(Counter, state CounterState\)"):
        vf_env(stateful)


def test_an_unknown_id_names_the_import_error_and_what_is_installed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(VerifiersError, match=r"verifiers environment 'vf-summs' cannot be loaded: ModuleNotFoundError: "
                                             r"taskset 'vf-summs' not found .* \(installed verifiers environments: "):
        vf_env("vf-summs")
    code, out = run_start(tmp_path, monkeypatch, capsys, '[env]\nname = "verifiers"\nverifiers = {id = "vf-summs"}\n')
    assert code == 2 and "Traceback" not in out
    assert "environment 'verifiers' cannot produce its tasks: VerifiersError: verifiers environment 'vf-summs' " \
           "cannot be loaded" in out


@pytest.mark.parametrize(("env", "message"), [
    ({"name": "verifiers"}, "env.name 'verifiers' needs env.verifiers"),
    ({"name": "arithmetic", "verifiers": {"id": "vf-sums"}}, "env.verifiers is set, but env.name is 'arithmetic'"),
    ({"name": "verifiers", "eval_size": 5, "verifiers": {"id": "vf-sums"}},
     "env.eval_size does not apply to a verifiers environment"),
    ({"name": "verifiers", "verifiers": {"id": "vf-sums", "args": {"id": "x"}}}, "env.verifiers.args sets 'id'"),
])
def test_verifiers_settings_are_checked_with_the_config(env: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EnvConfig.model_validate(env)


def test_args_the_taskset_does_not_take_are_refused_by_its_own_config() -> None:
    with pytest.raises(VerifiersError, match="(?s)env.verifiers.args do not fit its SumsConfig: .*max_operand"):
        vf_env("vf-sums", args={"max_operand": "many"})
    with pytest.raises(VerifiersError, match="eval_tasks is 100, but it has only 100 tasks"):
        vf_env("vf-sums", eval_tasks=100)


def test_importing_rlpipe_does_not_import_verifiers() -> None:
    code = ("import sys, rlpipe, rlpipe.envs.registry, rlpipe.graders.registry, rlpipe.schemas.config; "
            "print('verifiers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip() == "False"
