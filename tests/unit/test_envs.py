"""Environments: prompt sets, the tool-call text protocol, the calculator, the code environment."""

import doctest
import io
import json
import os
import random
import re
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass

import pytest
from pydantic import ValidationError

import rlpipe.envs.base
import rlpipe.envs.registry
from rlpipe.envs.arithmetic import ArithmeticEnv, evaluate_chain
from rlpipe.envs.base import Environment, Problem, Rubric, SandboxFailed, Task, ToolResult
from rlpipe.envs.calculator import CalcError, evaluate_expression, format_number
from rlpipe.envs.code import FAMILIES, VERDICT_MARKER, Verdict, build_test_program, read_verdict, strip_code_fence
from rlpipe.envs.registry import UnknownEnvironment, build_environment
from rlpipe.envs.toolcalls import Final, ToolCall, ToolCalls, parse_action, to_clean_text, truncate_middle
from rlpipe.schemas.task import ArithmeticDifficulty, EnvConfig

TOOLS = ("calc",)
UNTERMINATED = "unterminated <calc>: close it with </calc>"
EMPTY = "empty <calc></calc>: put the input between the tags"


def make_env(name: str = "arithmetic", **config: object) -> Environment:
    return build_environment(EnvConfig(name=name, **config))


@dataclass(frozen=True)
class FakeOutcome:
    status: str
    stdout: str
    stderr: str = ""
    reason: str | None = None


async def run_in_process(code: str, *, timeout_s: float) -> FakeOutcome:
    """A stand-in for the sandbox, for pure logic only: exec in this process, capture the output."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            exec(code, {"__name__": "__main__"})
    except Exception as e:
        return FakeOutcome("error", out.getvalue(), f"{type(e).__name__}: {e}", "exit status 1")
    return FakeOutcome("ok", out.getvalue(), err.getvalue())


async def never_called(code: str, *, timeout_s: float) -> FakeOutcome:
    raise AssertionError("this tool must not reach the executor")


# --- prompt sets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["arithmetic", "arithmetic_plain", "calculator", "code"])
def test_same_seed_gives_the_same_prompt_sets_and_another_seed_does_not(name: str) -> None:
    first, again, other = make_env(name, seed=7), make_env(name, seed=7), make_env(name, seed=8)
    for split in ("train", "eval"):
        questions = [first.task(split, i) for i in range(20)]
        assert questions == [again.task(split, i) for i in range(20)]
        assert [t.question for t in questions] != [other.task(split, i).question for i in range(20)]


def test_golden_first_tasks_pin_the_generator() -> None:
    # If this fails, seed 0 no longer reproduces the data of earlier runs: say so in the change.
    env = make_env("arithmetic", difficulty=ArithmeticDifficulty(operators=("+", "-", "*")))
    task = env.task("train", 0)
    assert (task.id, task.question, task.reference) == ("arithmetic:0:train:0", "What is 47 * 47?", "2209")
    assert 47 * 47 == 2209


def test_prompt_sets_do_not_depend_on_the_process() -> None:
    script = (
        "from rlpipe.envs.registry import build_environment; from rlpipe.schemas.task import EnvConfig;"
        "env = build_environment(EnvConfig(name='code', seed=3));"
        "print([env.task('train', i).question for i in range(5)])"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        ).stdout
        for hash_seed in ("1", "2")
    }
    assert len(outputs) == 1
    env = make_env("code", seed=3)
    assert outputs.pop().strip() == repr([env.task("train", i).question for i in range(5)])


def test_eval_questions_are_distinct_and_never_in_train() -> None:
    # 1-digit a + b has exactly 100 questions: small enough that collisions would happen
    tiny = ArithmeticDifficulty(num_operands=2, min_digits=1, max_digits=1, operators=("+",))
    env = make_env("arithmetic", difficulty=tiny, eval_size=40, train_size=400)
    eval_questions = [env.task("eval", i).question for i in range(40)]
    train_questions = {env.task("train", i).question for i in range(400)}
    assert len(set(eval_questions)) == 40
    assert not train_questions & set(eval_questions)
    assert len(train_questions) == 60  # 400 draws cover every one of the 100 - 40 remaining questions


def test_a_difficulty_too_small_for_the_eval_size_is_a_clear_error() -> None:
    tiny = ArithmeticDifficulty(num_operands=2, min_digits=1, max_digits=1, operators=("+",))
    env = make_env("arithmetic", difficulty=tiny, eval_size=101)
    with pytest.raises(ValueError, match="widen the difficulty or lower eval_size"):
        env.task("eval", 0)


def test_indices_and_splits_are_checked() -> None:
    env = make_env("arithmetic", train_size=5, eval_size=2)
    with pytest.raises(IndexError, match=r"train index 5 is outside 0..4"):
        env.task("train", 5)
    with pytest.raises(IndexError):
        env.task("eval", -1)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        env.task("test", 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("operands", "operators", "value"),
    [([48, 7, 3], ["-", "*"], 27), ([2, 3, 4], ["*", "+"], 10), ([5, 2, 3], ["-", "-"], 0), ([9], [], 9)],
)
def test_evaluate_chain_applies_precedence(operands: list[int], operators: list[str], value: int) -> None:
    assert evaluate_chain(operands, operators) == value


@pytest.mark.parametrize("name", ["arithmetic", "calculator"])
def test_references_agree_with_the_independent_calculator(name: str) -> None:
    env = make_env(name)
    for index in range(100):
        task = env.task("train", index)
        assert task.question == f"What is {task.metadata['expression']}?"
        assert task.reference == format_number(evaluate_expression(task.metadata["expression"]))


def test_difficulty_defaults_and_knobs() -> None:
    calc = make_env("calculator")
    assert calc.max_turns == 4 and make_env("arithmetic").max_turns == 1
    expression = calc.task("train", 0).metadata["expression"]
    assert len(expression.split()) == 5  # 3 operands, 2 operators
    knobbed = make_env("arithmetic", difficulty=ArithmeticDifficulty(num_operands=4, min_digits=3, max_digits=3))
    numbers = knobbed.task("train", 0).metadata["expression"].split()[::2]
    assert len(numbers) == 4 and all(len(n) == 3 for n in numbers)


def test_initial_messages_and_stop_sequences() -> None:
    env = make_env("calculator")
    task = env.task("eval", 3)
    messages = env.initial_messages(task)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"] == task.question and "<calc>" in messages[0]["content"]
    assert env.stop_sequences == ("</answer>", "</calc>")
    assert make_env("arithmetic").stop_sequences == ("</answer>",)


# --- the tool-call text protocol -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("<answer>84</answer>", Final("84")),
        ("12*7 is 84. <answer> 84 </answer> trailing", Final("84")),
        ("<calc>12*7</calc>", ToolCalls((ToolCall("calc", "12*7"),))),
        ("a <calc>1+1</calc> b <calc> 2*3 </calc>", ToolCalls((ToolCall("calc", "1+1"), ToolCall("calc", "2*3")))),
        # an answer after a call is ignored: the model has not seen the result yet
        ("<calc>1+1</calc> so <answer>2</answer>", ToolCalls((ToolCall("calc", "1+1"),))),
        ("<answer>5</answer> <calc>1+1</calc>", Final("5")),
        # tags of tools the environment does not have are plain text
        ("<python>print(1)</python>", Final(None, "no <answer>...</answer> in the response")),
        ("just words", Final(None, "no <answer>...</answer> in the response")),
        ("<answer>84", Final(None, "unterminated <answer>: no </answer> after it")),
        ("<calc>12*7", ToolCalls((ToolCall("calc", "12*7", UNTERMINATED),))),
        ("<calc>  </calc>", ToolCalls((ToolCall("calc", "", EMPTY),))),
        ("<calc>1</calc><calc>2", ToolCalls((ToolCall("calc", "1"), ToolCall("calc", "2", UNTERMINATED)))),
    ],
)
def test_parse_action(text: str, action: object) -> None:
    assert parse_action(text, TOOLS, max_calls=4) == action


def test_calls_beyond_the_per_turn_limit_become_one_error() -> None:
    action = parse_action("".join(f"<calc>{i}</calc>" for i in range(7)), TOOLS, max_calls=4)
    assert isinstance(action, ToolCalls)
    assert [c.arguments for c in action.calls] == ["0", "1", "2", "3", "4"]
    skipped = "skipped: at most 4 tool calls per turn; this call and any later ones did not run"
    assert [c.error for c in action.calls] == [None] * 4 + [skipped]


def test_parse_never_raises_on_junk() -> None:
    rng = random.Random(0)
    pieces = ["<calc>", "</calc>", "<answer>", "</answer>", "<", ">", "1+1", "\x00", "\udcff", "</"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert isinstance(parse_action(text, TOOLS, max_calls=2), ToolCalls | Final)


def test_huge_output_keeps_head_and_tail_and_counts_the_cut() -> None:
    text = "H" * 500_000 + "T" * 500_000
    shown = truncate_middle(text, 2000)
    assert len(shown) == 2000
    head, cut, tail = re.fullmatch(r"(H+)\n\.\.\.\[(\d+) characters cut\]\.\.\.\n(T+)", shown).groups()
    assert len(head) + int(cut) + len(tail) == 1_000_000
    assert abs(len(head) - len(tail)) <= 1
    assert truncate_middle("short", 5) == "short"


def test_binary_and_non_utf8_output_becomes_clean_text() -> None:
    assert to_clean_text(b"ok\xff\xfe\x00end\r\n") == "ok\ufffd\ufffd\ufffdend\n"
    assert to_clean_text("a\udce2b\x1b[0m\ttab") == "a?b\ufffd[0m\ttab"  # lone surrogate, ESC
    assert to_clean_text("héllo ✓".encode()) == "héllo ✓"


def test_observation_truncates_and_reports_errors() -> None:
    env = make_env("code", max_observation_chars=100)
    call = ToolCall("python", "print('x' * 10**6)")
    huge = env.observation(call, ToolResult(ok=True, output=b"x" * 10**6 + b"\xff"))
    assert len(huge) == 100 and huge.startswith("x") and huge.endswith("\ufffd")
    error = env.observation(call, ToolResult(ok=False, output=b"Traceback\x00", reason="exit status 1"))
    assert error == "error: exit status 1\nTraceback\ufffd"


# --- the calculator ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "shown"),
    [
        ("12*7", "84"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("7/2", "3.5"), ("8/2", "4"), ("7//2", "3"),
        ("7%3", "1"), ("-3**2", "-9"), ("2^10", "1024"), ("12 × 7", "84"), ("9 ÷ 4", "2.25"),
        ("347*29", "10063"), ("2**4095", str(2**4095)),
    ],
)
def test_calculator_evaluates_arithmetic(expression: str, shown: str) -> None:
    assert format_number(evaluate_expression(expression)) == shown


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os').system('true')", r"unsupported syntax \(Call\)"),
        ("(1).__class__", r"unsupported syntax \(Attribute\)"),
        ("x + 1", r"unsupported syntax \(Name\)"),
        ("lambda: 1", r"unsupported syntax \(Lambda\)"),
        ("[1, 2]", r"unsupported syntax \(List\)"),
        ("'a' * 3", r"unsupported syntax \(Constant\)"),
        ("True + 1", r"unsupported syntax \(Constant\)"),
        ("1j * 2", r"unsupported syntax \(Constant\)"),
        ("9**9**9", "result too large"),
        ("10**5000", "result too large"),
        ("2**4096", "result too large"),
        ("(2**4000) * 1.5", "result too large"),
        ("10.0**400", "result too large"),
        ("1e308 * 10", "not a finite number"),
        ("(-8) ** 0.5", "not a real number"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1\x00", "not an arithmetic expression"),
        ("1+" * 100 + "1", "longer than 200 characters"),
    ],
)
@pytest.mark.timeout(10)  # without the size guard, 9**9**9 would run for hours instead of failing
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression: str, error: str) -> None:
    started = time.perf_counter()
    with pytest.raises(CalcError, match=error):
        evaluate_expression(expression)
    assert time.perf_counter() - started < 0.5  # huge powers are refused before they are computed


async def test_calculator_episode_runs_the_tool_and_shows_the_result() -> None:
    env = make_env("calculator")
    task = env.task("train", 0)
    action = env.step(task, "I need 12*7. <calc>12*7</calc>")
    assert action == ToolCalls((ToolCall("calc", "12*7"),))
    result = await env.run_tool(action.calls[0], never_called)
    assert result == ToolResult(ok=True, output="84")
    assert env.observation(action.calls[0], result) == "84"
    assert env.step(task, "<answer>84</answer>") == Final("84")


async def test_calculator_errors_become_observations() -> None:
    env = make_env("calculator")
    unterminated = parse_action("<calc>12*7", env.tools, 4).calls[0]
    shown = env.observation(unterminated, await env.run_tool(unterminated, never_called))
    assert shown == "error: unterminated <calc>: close it with </calc>"
    bad = ToolCall("calc", "__import__('os')")
    assert (await env.run_tool(bad, never_called)).reason.startswith("unsupported syntax (Call)")
    unknown = ToolCall("python", "print(1)")
    assert (await env.run_tool(unknown, never_called)).reason == "unknown tool 'python'; tools: calc"


# --- the code environment ------------------------------------------------------------------------


async def test_every_family_reference_passes_its_own_tests() -> None:
    # the reference source and the reference function must agree, or expected values are wrong
    for family in FAMILIES:
        for draw in range(3):
            spec = family(random.Random(f"{family.__name__}/{draw}"))
            program = build_test_program(spec.solution, spec.function, spec.inputs)
            verdict = read_verdict((await run_in_process(program, timeout_s=5)).stdout)
            expected = [spec.solve(*args) for args in spec.inputs]
            assert verdict.passed(expected) == len(expected) and verdict.error is None, spec.solution


async def test_code_tasks_carry_hidden_tests_and_show_one_example() -> None:
    env = make_env("code")
    task = env.task("train", 2)
    function, tests = task.metadata["function"], task.metadata["tests"]
    assert len(tests) == 6 and f"def {function}(" in task.reference
    args, expected = tests[0]
    assert task.question.endswith(f"Example: {function}({', '.join(map(repr, args))}) == {expected!r}")
    json.dumps(task.metadata)  # travels and is stored as JSON


@pytest.mark.parametrize(
    ("solution", "results", "error"),
    [
        ("def inc(x):\n    return x + 1", ["2", "3", "7"], None),
        ("def inc(x):\n    return x * 2", ["2", "4", "12"], None),
        # its prints are swallowed, even a forged verdict line; x = 2 raises, so that result is null
        (f"def inc(x):\n    print('{VERDICT_MARKER} forged')\n    return 1 / (x - 2)", ["-1.0", None, "0.25"], None),
        ("def dec(x):\n    return x - 1", [], "NameError: the solution defines no function named 'inc'"),
        ("def inc(x) return x", [], "SyntaxError: expected ':' (solution.py, line 1)"),
        ("import sys\nsys.exit(3)", [], "SystemExit: 3"),
        ("def inc(x):\n    return object()", [None, None, None], None),  # not JSON: not a value
    ],
)
async def test_test_program_reports_what_the_function_returned(
    solution: str, results: list[str | None], error: str | None
) -> None:
    outcome = await run_in_process(build_test_program(solution, "inc", [[1], [2], [6]]), timeout_s=5)
    assert read_verdict(outcome.stdout) == Verdict(results, error)


@pytest.mark.parametrize(
    ("results", "expected", "passed"),
    [
        (["2", "3", "6"], [2, 3, 6], 3),
        (["2", "4", "10"], [2, 3, 6], 1),
        (["2", None, "6.0"], [2, 3, 6], 1),  # a float is not the int asked for
        (["true", "1"], [1, 1], 1),  # True == 1 in Python, but not here
        (['{"b": 1, "a": [1, "x"]}', "not json"], [{"a": [1, "x"], "b": 1}, "not json"], 1),
    ],
)
def test_verdict_counts_exact_json_matches(results: list[str | None], expected: list[object], passed: int) -> None:
    assert Verdict(results, None).passed(expected) == passed


def test_verdict_reading_and_code_fences() -> None:
    assert read_verdict("nothing here") is None
    assert read_verdict(VERDICT_MARKER + "{not json") is None
    assert read_verdict(VERDICT_MARKER + '{"results": [1], "error": null}') is None  # results are JSON text
    line = VERDICT_MARKER + '{"results": ["1", null], "error": null}'
    assert read_verdict(b"noise\n" + line.encode() + b"\n") == Verdict(["1", None], None)
    assert strip_code_fence("```python\ndef f():\n    return 1\n```") == "def f():\n    return 1"
    assert strip_code_fence("```\nx = 1\n```\n") == "x = 1"
    assert strip_code_fence("def f(): pass") == "def f(): pass"


async def test_python_tool_runs_through_the_executor() -> None:
    env = make_env("code")
    ok = await env.run_tool(ToolCall("python", "```python\nprint(6 * 7)\n```"), run_in_process)
    assert env.observation(ToolCall("python", ""), ok) == "42"
    silent = await env.run_tool(ToolCall("python", "x = 1"), run_in_process)
    assert silent == ToolResult(ok=True, output="(no output)")
    failed = await env.run_tool(ToolCall("python", "print('a')\n1/0"), run_in_process)
    assert failed == ToolResult(ok=False, output="a\nZeroDivisionError: division by zero", reason="exit status 1")


async def test_a_broken_sandbox_raises_instead_of_becoming_an_observation() -> None:
    async def broken(code: str, *, timeout_s: float) -> FakeOutcome:
        return FakeOutcome("sandbox_error", "", "", "could not create the namespace")

    with pytest.raises(SandboxFailed, match=r"\(sandbox_error\): could not create the namespace"):
        await make_env("code").run_tool(ToolCall("python", "print(1)"), broken)


# --- registry and config -------------------------------------------------------------------------


def test_unknown_environment_lists_the_known_ones() -> None:
    known = "known environments: arithmetic, arithmetic_plain, calculator, code, dataset, verifiers"
    with pytest.raises(UnknownEnvironment, match=f"unknown environment 'chess'; {known}"):
        rlpipe.envs.registry.ENVIRONMENTS.get("chess")
    with pytest.raises(ValidationError, match="env.name 'chess' is not a registered environment"):
        EnvConfig(name="chess")


def test_a_user_environment_plugs_in(monkeypatch: pytest.MonkeyPatch) -> None:
    class Reverse(Environment):
        name = "reverse"
        system_prompt = "Reverse the digits. Answer as <answer>...</answer>."
        rubric = Rubric({"answer_match": 1.0})  # integer references, as answer_match compares them

        def sample_problem(self, rng: random.Random) -> Problem:
            word = "".join(rng.choice("123456789") for _ in range(6))
            return Problem(question=f"Reverse: {word}", reference=word[::-1])

    registry = rlpipe.envs.registry.ENVIRONMENTS
    monkeypatch.setattr(registry, "_classes", dict(registry._classes))  # the plug-in is gone after the test
    rlpipe.envs.registry.register_environment(Reverse)
    env = build_environment(EnvConfig(name="reverse", eval_size=5))
    task = env.task("train", 0)
    assert task.reference == task.question.removeprefix("Reverse: ")[::-1]
    with pytest.raises(ValueError, match="'arithmetic' is already taken by ArithmeticEnv"):
        rlpipe.envs.registry.register_environment(type("Other", (ArithmeticEnv,), {"name": "arithmetic"}))


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Environments registered in the test are gone after it."""
    registry = rlpipe.envs.registry.ENVIRONMENTS
    monkeypatch.setattr(registry, "_classes", dict(registry._classes))


RUBRIC = Rubric({"answer_match": 1.0})


@pytest.mark.parametrize(("class_name", "attributes", "message"), [
    ("Nameless", {"system_prompt": "Add.", "rubric": RUBRIC},
     "environment class Nameless has no name: set the class attribute `name = \"...\"`"),
    ("Promptless", {"name": "promptless", "rubric": RUBRIC},
     "environment 'promptless' (class Promptless) has no system_prompt"),
    ("Rubricless", {"name": "rubricless", "system_prompt": "Add."},
     "environment 'rubricless' (class Rubricless) needs a rubric, found none: set the class attribute "
     "`rubric = Rubric({grader name: weight})`"),
    ("DictRubric", {"name": "dict_rubric", "system_prompt": "Add.", "rubric": {"answer_match": 1.0}},
     "environment 'dict_rubric' (class DictRubric) needs a rubric, found a dict"),
])
def test_registration_names_the_class_and_what_it_lacks(
        scratch_registry: None, class_name: str, attributes: dict[str, object], message: str) -> None:
    def sample_problem(self: Environment, rng: random.Random) -> Problem:
        return Problem("What is 1 + 1?", "2")

    incomplete = type(class_name, (Environment,), {**attributes, "sample_problem": sample_problem})
    with pytest.raises(TypeError, match=re.escape(message)):
        rlpipe.envs.registry.register_environment(incomplete)


def test_the_module_docstring_example_runs(scratch_registry: None) -> None:
    """The example that shows how to bring your own environment, run as written (it registers one)."""
    result = doctest.testmod(rlpipe.envs.base, raise_on_error=False)
    assert result.attempted >= 10 and result.failed == 0, "the example in envs/base.py fails: see the output"


def test_env_config_messages_name_the_field_and_the_fix() -> None:
    with pytest.raises(ValidationError, match=r"difficulty.min_digits \(3\) is above difficulty.max_digits \(2\)"):
        ArithmeticDifficulty(min_digits=3, max_digits=2)
    with pytest.raises(ValidationError, match="extra_forbidden"):
        EnvConfig(seeds=1)
    with pytest.raises(ValidationError, match="name at least one"):
        ArithmeticDifficulty(operators=())
    assert EnvConfig().name == "arithmetic"


def test_rubric_reward_is_the_weighted_mean() -> None:
    rubric = Rubric({"answer_match": 3.0, "judge": 1.0})
    assert rubric.reward({"answer_match": 1.0, "judge": 0.0}) == 0.75
    with pytest.raises(ValueError, match=r"no score from rubric grader\(s\) \['judge'\]"):
        rubric.reward({"answer_match": 1.0})
    with pytest.raises(ValueError, match="positive weights"):
        Rubric({"judge": 0.0})


def test_task_is_plain_data() -> None:
    task = make_env("arithmetic").task("eval", 0)
    assert isinstance(task, Task) and task.split == "eval" and task.index == 0
