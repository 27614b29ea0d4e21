"""Write a small Python function; hidden unit tests, run in the sandbox, decide the reward.

    user:      Write a Python function clamp(x) that returns x limited to the range -7..31.
               Example: clamp(40) == 31
    assistant: <python>def clamp(x): return max(-7, min(31, x))
               print(clamp(40))</python>                    (optional: try code first)
    tool:      31
    assistant: <answer>def clamp(x):
                   return max(-7, min(31, x))</answer>

Problems come from a few function families with drawn constants, so eval questions are new
variants the policy has not trained on. Each family gives the reference solution both as source
(the task's reference, for judges and warm-up data) and as a Python function (to compute the
expected values); a unit test keeps the two in agreement.

The hidden tests travel in the task's metadata; `build_test_program` turns a candidate solution and
the tests' inputs into one program for the sandbox, and `read_verdict` reads back what it returned.
"""

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from string import ascii_lowercase
from typing import Any

from rlpipe.envs.base import Environment, Executor, Problem, Rubric, ToolResult, check_sandbox
from rlpipe.envs.toolcalls import ToolCall, to_clean_text

TESTS_PER_PROBLEM = 6
VERDICT_MARKER = "@@rlpipe-verdict@@"  # starts the test program's last line of output


@dataclass(frozen=True)
class FunctionSpec:
    """One drawn problem: the function to write, its reference in two forms, and test inputs."""

    function: str
    signature: str
    description: str
    solution: str  # reference source
    solve: Callable[..., Any]  # the same reference, to compute expected values
    inputs: list[list[Any]]  # positional arguments of each test


def _ints(rng: random.Random, low: int, high: int) -> list[list[Any]]:
    return [[rng.randint(low, high)] for _ in range(TESTS_PER_PROBLEM)]


def _int_lists(rng: random.Random, low: int, high: int) -> list[list[Any]]:
    return [[[rng.randint(low, high) for _ in range(rng.randint(0, 6))]] for _ in range(TESTS_PER_PROBLEM)]


def _strings(rng: random.Random, alphabet: str, max_len: int) -> list[list[Any]]:
    def draw() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len)))

    return [[draw()] for _ in range(TESTS_PER_PROBLEM)]


def add_offset(rng: random.Random) -> FunctionSpec:
    k = rng.randint(2, 99)
    return FunctionSpec(
        "add_offset", "add_offset(x)", f"returns x plus {k}",
        f"def add_offset(x):\n    return x + {k}\n", lambda x: x + k, _ints(rng, -100, 100),
    )


def count_above(rng: random.Random) -> FunctionSpec:
    t = rng.randint(-20, 20)
    return FunctionSpec(
        "count_above", "count_above(xs)", f"returns how many numbers in the list xs are greater than {t}",
        f"def count_above(xs):\n    return sum(1 for x in xs if x > {t})\n",
        lambda xs: sum(1 for x in xs if x > t), _int_lists(rng, -30, 30),
    )


def clamp(rng: random.Random) -> FunctionSpec:
    low, high = rng.randint(-50, 0), rng.randint(1, 50)
    return FunctionSpec(
        "clamp", "clamp(x)", f"returns x limited to the range {low}..{high}",
        f"def clamp(x):\n    return max({low}, min({high}, x))\n",
        lambda x: max(low, min(high, x)), _ints(rng, -80, 80),
    )


def repeat_word(rng: random.Random) -> FunctionSpec:
    times, sep = rng.randint(2, 5), rng.choice(["-", ",", " ", "+", "/", "."])
    return FunctionSpec(
        "repeat_word", "repeat_word(s)", f"returns the string s repeated {times} times, joined by {sep!r}",
        f"def repeat_word(s):\n    return {sep!r}.join([s] * {times})\n",
        lambda s: sep.join([s] * times), _strings(rng, ascii_lowercase, 8),
    )


def count_letter(rng: random.Random) -> FunctionSpec:
    letter = rng.choice(ascii_lowercase[:8])  # early letters, so the drawn words contain them
    return FunctionSpec(
        "count_letter", "count_letter(s)", f"returns how many times the letter {letter!r} occurs in the string s",
        f"def count_letter(s):\n    return s.count({letter!r})\n", lambda s: s.count(letter),
        _strings(rng, ascii_lowercase[:8], 10),
    )


def sum_powers(rng: random.Random) -> FunctionSpec:
    start, power = rng.randint(0, 5), rng.randint(1, 3)
    return FunctionSpec(
        "sum_powers", "sum_powers(n)",
        f"returns the sum of i**{power} for every integer i from {start} to n inclusive",
        f"def sum_powers(n):\n    return sum(i**{power} for i in range({start}, n + 1))\n",
        lambda n: sum(i**power for i in range(start, n + 1)), _ints(rng, 0, 20),
    )


def fizz_label(rng: random.Random) -> FunctionSpec:
    a, b = rng.sample(range(2, 8), 2)
    return FunctionSpec(
        "fizz_label", "fizz_label(n)",
        f"returns 'Fizz' if n is divisible by {a}, otherwise 'Buzz' if n is divisible by {b}, otherwise str(n)",
        f"def fizz_label(n):\n    if n % {a} == 0:\n        return 'Fizz'\n    if n % {b} == 0:\n"
        f"        return 'Buzz'\n    return str(n)\n",
        lambda n: "Fizz" if n % a == 0 else "Buzz" if n % b == 0 else str(n), _ints(rng, 1, 60),
    )


def digit_sum(rng: random.Random) -> FunctionSpec:
    base = rng.randint(2, 16)
    return FunctionSpec(
        "digit_sum", "digit_sum(n)",
        f"returns the sum of the digits of the non-negative integer n written in base {base}",
        f"def digit_sum(n):\n    total = 0\n    while n:\n        total += n % {base}\n"
        f"        n //= {base}\n    return total\n",
        lambda n: _digit_sum(n, base), _ints(rng, 0, 5000),
    )


def _digit_sum(n: int, base: int) -> int:
    total = 0
    while n:
        total, n = total + n % base, n // base
    return total


def scale_list(rng: random.Random) -> FunctionSpec:
    k, c = rng.randint(2, 9), rng.randint(-9, 9)
    return FunctionSpec(
        "scale_list", "scale_list(xs)",
        f"returns a new list with every number x of the list xs replaced by x * {k} + {c}",
        f"def scale_list(xs):\n    return [x * {k} + {c} for x in xs]\n",
        lambda xs: [x * k + c for x in xs], _int_lists(rng, -20, 20),
    )


FAMILIES: tuple[Callable[[random.Random], FunctionSpec], ...] = (
    add_offset, count_above, clamp, repeat_word, count_letter, sum_powers, fizz_label, digit_sum, scale_list,
)


def call_text(function: str, args: list[Any]) -> str:
    return f"{function}({', '.join(map(repr, args))})"


# The candidate runs in its own namespace with its output swallowed, so neither its names nor its
# prints can disturb the verdict line. Only the test inputs enter the sandbox: the program reports
# what the function returned and the grader compares that with the expected values, which the code
# never sees, so no trick inside the sandbox (patching json, an __eq__ that always says True,
# forging the verdict line) can earn a pass without producing the right values; the marker need
# not be secret.
_TEST_PROGRAM = """\
import contextlib as _contextlib, io as _io, json as _json
_results, _error = [], None
_namespace = {{"__name__": "solution"}}
try:
    with _contextlib.redirect_stdout(_io.StringIO()), _contextlib.redirect_stderr(_io.StringIO()):
        exec(compile({solution!r}, "solution.py", "exec"), _namespace)
        if not callable(_namespace.get({function!r})):
            raise NameError({missing!r})
        for _args in _json.loads({inputs!r}):
            try:
                _results.append(_json.dumps(_namespace[{function!r}](*_args)))
            except Exception:
                _results.append(None)
except BaseException as _exception:
    _error = type(_exception).__name__ + ": " + str(_exception)
print({VERDICT_MARKER!r} + _json.dumps({{"results": _results, "error": _error}}))
"""


def build_test_program(solution: str, function: str, inputs: list[list[Any]]) -> str:
    """One program that defines `solution`, calls it on every argument list in `inputs`, and prints a
    verdict line: VERDICT_MARKER, then JSON {"results": [JSON of each return value, or null], "error"}."""
    return _TEST_PROGRAM.format(
        solution=solution, function=function, inputs=json.dumps(inputs), VERDICT_MARKER=VERDICT_MARKER,
        missing=f"the solution defines no function named {function!r}",
    )


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


@dataclass(frozen=True)
class Verdict:
    """What the test program reported: each call's return value as JSON (None: it raised)."""

    results: list[str | None]
    error: str | None  # the solution failed as a whole (syntax error, missing function, exit)

    def passed(self, expected: list[Any]) -> int:
        """How many results equal the expected values, compared as canonical JSON (so True != 1)."""
        passed = 0
        for result, want in zip(self.results, expected, strict=True):
            try:
                passed += result is not None and _canonical(json.loads(result)) == _canonical(want)
            except ValueError:  # not JSON after all
                pass
        return passed


def read_verdict(stdout: str | bytes) -> Verdict | None:
    """The last verdict printed by `build_test_program`'s program, or None if it printed no valid one."""
    lines = [line for line in to_clean_text(stdout).splitlines() if line.startswith(VERDICT_MARKER)]
    if not lines:
        return None
    try:
        report = json.loads(lines[-1][len(VERDICT_MARKER):])
        results, error = report["results"], report["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(results, list) or not all(r is None or isinstance(r, str) for r in results):
        return None
    return Verdict(results, error if isinstance(error, str) else None)


_FENCE = re.compile(r"```[\w+-]*[ \t]*\n(.*?)\n?[ \t]*```", re.DOTALL)


def strip_code_fence(text: str) -> str:
    """The code inside a markdown fence, if the model wrapped it in one (a habit of chat models)."""
    match = _FENCE.fullmatch(text.strip())
    return match.group(1) if match else text


class CodeEnv(Environment):
    """Write one Python function; a <python> tool lets the model try code before answering."""

    name = "code"
    tools = ("python",)
    default_max_turns = 3
    system_prompt = (
        "Write the Python function the user asks for. You may run code first with "
        "<python>code</python> and you will see what it prints. Give the final function inside "
        "answer tags, for example: <answer>def double(x):\n    return 2 * x</answer>"
    )
    rubric = Rubric({"code_tests": 1.0})

    def sample_problem(self, rng: random.Random) -> Problem:
        family = rng.choice(FAMILIES)
        spec = family(rng)
        tests = [[args, spec.solve(*args)] for args in spec.inputs]
        example_args, example_expected = tests[0]
        question = (
            f"Write a Python function {spec.signature} that {spec.description}.\n"
            f"Example: {call_text(spec.function, example_args)} == {example_expected!r}"
        )
        return Problem(
            question=question,
            reference=spec.solution,
            metadata={"family": family.__name__, "function": spec.function, "tests": tests},
        )

    async def execute_tool(self, call: ToolCall, executor: Executor) -> ToolResult:
        """Run the model's code in the sandbox and show it stdout, then stderr."""
        code = strip_code_fence(call.arguments)
        outcome = check_sandbox(await executor(code, timeout_s=self.config.tool_timeout_s))
        streams = (to_clean_text(outcome.stdout).rstrip(), to_clean_text(outcome.stderr).rstrip())
        output = "\n".join(text for text in streams if text)
        if outcome.status != "ok":
            return ToolResult(ok=False, output=output, reason=outcome.reason or outcome.status)
        return ToolResult(ok=True, output=output or "(no output)")
