"""Rule-based graders: the answer tag against the reference, and hidden unit tests in the sandbox.

Both read the answer with `envs.toolcalls.extract_answer`, the same rule the environment uses to end
an episode, so what ends the episode and what gets graded never disagree. A missing or malformed
answer scores 0 with `format_ok: False` and the reason, so format failures are visible in the
grade details rather than mixed in with wrong answers.
"""

import asyncio

from rlpipe.envs.base import Executor, Task, check_sandbox
from rlpipe.envs.code import build_test_program, read_verdict, strip_code_fence
from rlpipe.envs.toolcalls import INTEGER_ANSWER, extract_answer, to_clean_text
from rlpipe.graders.base import Grader, GraderDeps, GradeResult
from rlpipe.schemas.task import GraderConfig

DETAIL_CHARS = 500  # how much of a bad answer or stderr the details keep


class AnswerMatchGrader(Grader):
    """1.0 if the <answer> tag holds exactly the reference integer, else 0.0.

    Reasoning before the tag is fine; inside the tag only the integer (and whitespace) is accepted,
    so "<answer>The answer is 84</answer>" is a format error, not a lucky match.
    """

    name = "answer_match"
    version = "1"

    async def score(self, task: Task, response_text: str) -> GradeResult:
        if not INTEGER_ANSWER.fullmatch(task.reference.strip()):
            raise ValueError(
                f"answer_match needs an integer reference, task {task.id} has {task.reference[:50]!r}: "
                "use a grader that fits the environment"
            )
        final = extract_answer(response_text)
        if final.answer is None:
            return GradeResult(0.0, {"format_ok": False, "format_error": final.format_error})
        if not INTEGER_ANSWER.fullmatch(final.answer):
            error = f"the answer {final.answer[:DETAIL_CHARS]!r} is not a plain integer"
            return GradeResult(0.0, {"format_ok": False, "format_error": error})
        correct = int(final.answer) == int(task.reference)
        return GradeResult(float(correct), {"format_ok": True, "answer": final.answer, "correct": correct})


class FinalNumberGrader(Grader):
    """1.0 if the last integer in the response is the reference, else 0.0: no answer format to
    learn, for models too small to follow one (SmolLM2-135M never writes answer tags, see
    docs/task-calibration.md). Rambling is not rewarded by itself: a trailing restatement of the
    question ("... so 3 + 4") ends on the wrong number."""

    name = "final_number"
    version = "1"

    async def score(self, task: Task, response_text: str) -> GradeResult:
        if not INTEGER_ANSWER.fullmatch(task.reference.strip()):
            raise ValueError(f"final_number needs an integer reference, task {task.id} has {task.reference[:50]!r}")
        numbers = INTEGER_ANSWER.findall(response_text)
        if not numbers:
            return GradeResult(0.0, {"format_ok": False, "format_error": "the response contains no integer"})
        correct = int(numbers[-1]) == int(task.reference)
        return GradeResult(float(correct), {"format_ok": True, "answer": numbers[-1], "correct": correct})


class CodeTestsGrader(Grader):
    """Fraction of the task's hidden tests that the answered function passes, run in the sandbox.

    A program that crashes, loops past the timeout or never defines the function passes nothing;
    the details say which. A failing sandbox (the executor raising, or reporting that the code never
    ran) is not the model's fault and raises, so the grading is retried instead of scored 0.
    """

    name = "code_tests"
    version = "1"

    def __init__(self, executor: Executor, timeout_s: float, concurrency: int) -> None:
        self.executor = executor
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(concurrency)

    @classmethod
    def from_config(cls, config: GraderConfig, deps: GraderDeps) -> "CodeTestsGrader":
        if deps.executor is None:
            raise ValueError("the code_tests grader runs tests in the sandbox: pass GraderDeps(executor=...)")
        return cls(deps.executor, config.timeout_s, config.concurrency)

    async def score(self, task: Task, response_text: str) -> GradeResult:
        function, tests = task.metadata.get("function"), task.metadata.get("tests")
        if not function or not tests:
            raise ValueError(
                f"code_tests needs a task with metadata 'function' and 'tests' (the code environment's), "
                f"task {task.id} has keys {sorted(task.metadata)}"
            )
        final = extract_answer(response_text)
        if final.answer is None:
            return GradeResult(0.0, {"format_ok": False, "format_error": final.format_error})

        inputs = [args for args, _ in tests]  # the expected values never enter the sandbox
        program = build_test_program(strip_code_fence(final.answer), function, inputs)
        async with self._slots:
            outcome = check_sandbox(await self.executor(program, timeout_s=self.timeout_s))
        verdict = read_verdict(outcome.stdout)
        details: dict[str, object] = {"format_ok": True, "total": len(tests), "status": outcome.status}
        if verdict is None:
            error = outcome.reason or "the test program printed no verdict"
            stderr = to_clean_text(outcome.stderr)[-DETAIL_CHARS:]
            return GradeResult(0.0, {**details, "passed": 0, "error": error, "stderr": stderr})
        if verdict.error is None and len(verdict.results) != len(tests):
            error = f"the verdict has {len(verdict.results)} results for {len(tests)} tests"
            return GradeResult(0.0, {**details, "passed": 0, "error": error})
        # a solution that failed as a whole may have no results at all: nothing passed
        passed = verdict.passed([expected for _, expected in tests]) if verdict.error is None else 0
        solution_error = verdict.error[:DETAIL_CHARS] if verdict.error else None
        return GradeResult(passed / len(tests), {**details, "passed": passed, "error": solution_error})
