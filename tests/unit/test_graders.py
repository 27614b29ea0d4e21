"""Graders: rule graders, the LLM judge over a mock transport, validation, cache keys and the LRU."""

import asyncio
import hashlib
import io
import json
import math
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass

import httpx
import pytest
from pydantic import ValidationError

from rlpipe.envs.base import Rubric, SandboxFailed, Task
from rlpipe.envs.code import VERDICT_MARKER
from rlpipe.graders.base import Grader, GraderDeps, GradeResult, InvalidGrade, validate_grade
from rlpipe.graders.cache import InMemoryGradeCache, canonical_json, grade_cache_key, grade_with_cache
from rlpipe.graders.judge import JudgeGrader, JudgeRequestRefused, UnparsableJudgeOutput, endpoint_url
from rlpipe.graders.registry import GRADERS, UnknownGrader, build_grader, build_rubric_graders
from rlpipe.graders.rules import AnswerMatchGrader, CodeTestsGrader, FinalNumberGrader
from rlpipe.schemas.task import GraderConfig, JudgeConfig

MATH_TASK = Task(id="t:0", split="eval", index=0, question="What is 12 * 7?", reference="84")
CODE_TASK = Task(
    id="c:0", split="eval", index=0, question="Write inc(x) that returns x plus 1.", reference="def inc(x): ...",
    metadata={"function": "inc", "tests": [[[1], 2], [[2], 3], [[5], 6]]},
)


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


# --- answer_match --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "score", "format_ok"),
    [
        ("<answer>84</answer>", 1.0, True),
        ("12 * 7 = 84, so <answer> 84 </answer>", 1.0, True),  # reasoning before the tag is fine
        ("<answer>84</answer> and then some more text", 1.0, True),
        ("<answer>+84</answer>", 1.0, True),
        ("<answer>85</answer>", 0.0, True),
        ("<answer>-84</answer>", 0.0, True),
        ("84", 0.0, False),
        ("<answer>84", 0.0, False),
        ("<answer>The answer is 84</answer>", 0.0, False),
        ("<answer>84.0</answer>", 0.0, False),
        ("<answer>٨٤</answer>", 0.0, False),  # Arabic-Indic digits are not a plain integer
        ("<answer>" + "9" * 5000 + "</answer>", 0.0, False),
    ],
)
async def test_answer_match(response: str, score: float, format_ok: bool) -> None:
    result = await AnswerMatchGrader().grade(MATH_TASK, response)
    assert (result.score, result.details["format_ok"]) == (score, format_ok)


@pytest.mark.parametrize(
    ("response", "score", "format_ok"),
    [
        ("84", 1.0, True),
        ("The answer is 84.", 1.0, True),
        ("80 + 4 = 84", 1.0, True),
        ("84, not 85", 0.0, True),        # the LAST integer counts
        ("It is -84", 0.0, True),
        ("<answer>84</answer>", 1.0, True),
        ("eighty-four", 0.0, False),
        ("", 0.0, False),
    ],
)
async def test_final_number(response: str, score: float, format_ok: bool) -> None:
    result = await FinalNumberGrader().grade(MATH_TASK, response)
    assert (result.score, result.details["format_ok"]) == (score, format_ok)


async def test_answer_match_explains_format_errors() -> None:
    missing = await AnswerMatchGrader().grade(MATH_TASK, "84")
    assert missing.details["format_error"] == "no <answer>...</answer> in the response"
    wordy = await AnswerMatchGrader().grade(MATH_TASK, "<answer>it is 84</answer>")
    assert wordy.details["format_error"] == "the answer 'it is 84' is not a plain integer"


async def test_answer_match_refuses_a_non_integer_reference() -> None:
    with pytest.raises(ValueError, match="answer_match needs an integer reference, task c:0"):
        await AnswerMatchGrader().grade(CODE_TASK, "<answer>1</answer>")


# --- code_tests ----------------------------------------------------------------------------------


def code_grader(executor: object = run_in_process) -> CodeTestsGrader:
    return CodeTestsGrader(executor, timeout_s=5, concurrency=2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("response", "score", "passed"),
    [
        ("<answer>def inc(x):\n    return x + 1</answer>", 1.0, 3),
        ("<answer>```python\ndef inc(x):\n    return x + 1\n```</answer>", 1.0, 3),
        ("<answer>def inc(x):\n    return x * 2</answer>", 1 / 3, 1),  # 1*2 == 2 only
        ("<answer>def inc(x):\n    return 2 if x == 1 else 6</answer>", 2 / 3, 2),  # x = 1 and x = 5
        ("<answer>def inc(x) return x</answer>", 0.0, 0),
    ],
)
async def test_code_tests_score_is_the_pass_fraction(response: str, score: float, passed: int) -> None:
    result = await code_grader().grade(CODE_TASK, response)
    assert result.score == pytest.approx(score)
    assert (result.details["passed"], result.details["total"]) == (passed, 3)


async def test_code_tests_details_say_what_went_wrong() -> None:
    syntax = await code_grader().grade(CODE_TASK, "<answer>def inc(x) return x</answer>")
    assert syntax.details["error"].startswith("SyntaxError")
    missing = await code_grader().grade(CODE_TASK, "def inc(x): return x + 1")
    assert (missing.score, missing.details["format_ok"]) == (0.0, False)

    async def timed_out(code: str, *, timeout_s: float) -> FakeOutcome:
        return FakeOutcome("timeout", "", "", f"killed after {timeout_s} s")

    slow = await code_grader(timed_out).grade(CODE_TASK, "<answer>while True: pass</answer>")
    assert (slow.score, slow.details["status"], slow.details["error"]) == (0.0, "timeout", "killed after 5 s")


async def test_expected_values_never_enter_the_sandbox() -> None:
    task = Task(
        id="s:0", split="eval", index=0, question="Write shout(s).", reference="def shout(s): ...",
        metadata={"function": "shout", "tests": [[["a"], "secret-A!"], [["b"], "secret-B!"]]},
    )
    programs: list[str] = []

    async def recording(code: str, *, timeout_s: float) -> FakeOutcome:
        programs.append(code)
        return await run_in_process(code, timeout_s=timeout_s)

    answer = "<answer>def shout(s):\n    return 'secret-' + s.upper() + '!'</answer>"
    assert (await code_grader(recording).grade(task, answer)).score == 1.0
    assert "secret-A!" not in programs[0] and "'a'" not in programs[0] and '[["a"], ["b"]]' in programs[0]


async def test_code_tests_distrusts_a_malformed_verdict() -> None:
    async def forging(code: str, *, timeout_s: float) -> FakeOutcome:
        return FakeOutcome("ok", VERDICT_MARKER + json.dumps({"results": ["2"] * 5, "error": None}))

    result = await code_grader(forging).grade(CODE_TASK, "<answer>def inc(x): return x</answer>")
    assert result.score == 0.0 and result.details["error"] == "the verdict has 5 results for 3 tests"


async def test_code_tests_lets_sandbox_failures_propagate() -> None:
    async def broken(code: str, *, timeout_s: float) -> FakeOutcome:
        raise ConnectionError("sandbox unreachable")

    with pytest.raises(ConnectionError):
        await code_grader(broken).grade(CODE_TASK, "<answer>def inc(x): return x + 1</answer>")

    async def not_isolated(code: str, *, timeout_s: float) -> FakeOutcome:
        return FakeOutcome("sandbox_error", "", "", "no free uid")

    with pytest.raises(SandboxFailed, match="no free uid"):
        await code_grader(not_isolated).grade(CODE_TASK, "<answer>def inc(x): return x + 1</answer>")
    with pytest.raises(ValueError, match="code_tests needs a task with metadata 'function' and 'tests'"):
        await code_grader().grade(MATH_TASK, "<answer>84</answer>")
    with pytest.raises(ValueError, match=r"pass GraderDeps\(executor=...\)"):
        build_grader("code_tests", GraderConfig(), GraderDeps())


# --- the judge -----------------------------------------------------------------------------------


def judge_config(**changes: object) -> GraderConfig:
    judge = JudgeConfig(base_url="http://judge.test:8000/v1/", model="judge-7b").model_copy(update=changes)
    return GraderConfig(name="judge", judge=judge, concurrency=2, timeout_s=5)


def judge_with(handler, config: GraderConfig | None = None) -> tuple[JudgeGrader, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    async def recording(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return await handler(request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(recording))
    grader = build_grader("judge", config or judge_config(), GraderDeps(http_client=client))
    return grader, seen  # type: ignore[return-value]


def chat_reply(content: object) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": content}}]})


async def test_judge_scores_from_the_last_score_line() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return chat_reply("First thought SCORE: 2, but on reflection\nSCORE: 7")

    grader, seen = judge_with(handler, judge_config(reply_format="free_text"))
    result = await grader.grade(MATH_TASK, "<answer>84</answer>")
    assert result.score == pytest.approx(0.7)
    assert result.details["judge_score"] == 7.0 and result.details["judge_model"] == "judge-7b"

    (request,) = seen
    assert str(request.url) == "http://judge.test:8000/v1/chat/completions"
    body = json.loads(request.content)
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("judge-7b", 0.0, 512)
    assert "structured_outputs" not in body  # free text: the judge may reason before its score
    (message,) = body["messages"]
    assert message["role"] == "user"
    assert "What is 12 * 7?" in message["content"] and "<answer>84</answer>" in message["content"]
    assert "Reference answer:\n84" in message["content"]


async def test_judge_completions_api_and_auth_header(monkeypatch: pytest.MonkeyPatch) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"text": " 3/4 -> SCORE: 0.75"}]})

    monkeypatch.setenv("JUDGE_TOKEN", "s3cret")
    config = judge_config(api="completions", max_score=1.0, api_key_env="JUDGE_TOKEN", reply_format="free_text")
    grader, seen = judge_with(handler, config)
    assert (await grader.grade(MATH_TASK, "x")).score == 0.75
    assert seen[0].url.path == "/v1/completions" and "prompt" in json.loads(seen[0].content)
    assert seen[0].headers["authorization"] == "Bearer s3cret"


async def test_unparsable_judge_output_is_a_flagged_invalid_grade() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return chat_reply("I think the answer looks fine.")

    grader, _ = judge_with(handler)
    message = r"grader 'judge' produced an invalid grade 'I think the answer looks fine.'"
    with pytest.raises(UnparsableJudgeOutput, match=message) as caught:
        await grader.grade(MATH_TASK, "x")
    assert isinstance(caught.value, InvalidGrade) and "no score matching" in caught.value.reason


@pytest.mark.parametrize(
    "reply",
    [httpx.Response(200, json={"error": "no such model"}), httpx.Response(200, text="<html>"), chat_reply(None)],
)
async def test_a_reply_without_choices_text_is_unparsable(reply: httpx.Response) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return reply

    grader, _ = judge_with(handler)
    with pytest.raises(UnparsableJudgeOutput, match="OpenAI-compatible chat API"):
        await grader.grade(MATH_TASK, "x")


async def test_out_of_range_judge_scores_are_rejected() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return chat_reply("SCORE: 15")

    grader, _ = judge_with(handler)
    message = r"grader 'judge' produced an invalid grade 1.5: the score is outside \[0.0, 1.0\]"
    with pytest.raises(InvalidGrade, match=message):
        await grader.grade(MATH_TASK, "x")


async def test_a_structured_judge_may_only_reply_with_a_score() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return chat_reply("SCORE: 8")

    grader, seen = judge_with(handler)  # structured is the default
    assert (await grader.grade(MATH_TASK, "x")).score == pytest.approx(0.8)
    body = json.loads(seen[0].content)
    assert body["structured_outputs"] == {"choice": [f"SCORE: {i}" for i in range(11)]}


def test_structured_replies_follow_the_reply_template_and_max_score() -> None:
    judge = JudgeConfig(base_url="http://j:8000", model="m", max_score=3, structured_reply="{score}/3",
                        score_pattern=r"(\d)/3")
    assert judge.structured_replies() == ["0/3", "1/3", "2/3", "3/3"]


def test_structured_judge_config_errors_name_the_fix() -> None:
    base = {"base_url": "http://j:8000", "model": "m"}
    with pytest.raises(ValidationError, match=r"max_score 2.5 must be a whole number <= 100 .* 'free_text'"):
        JudgeConfig(**base, max_score=2.5)
    with pytest.raises(ValidationError, match=r"structured_reply 'SCORE' has no \{score\} field"):
        JudgeConfig(**base, structured_reply="SCORE")
    with pytest.raises(ValidationError, match=r"does not read the structured reply 'grade 0' as 0"):
        JudgeConfig(**base, structured_reply="grade {score}")
    assert JudgeConfig(**base, max_score=2.5, reply_format="free_text").max_score == 2.5


@pytest.mark.parametrize("reply_format", ["structured", "free_text"])
async def test_a_refused_request_is_an_invalid_grade_not_a_retry(reply_format: str) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, text="unknown field: structured_outputs")

    grader, _ = judge_with(handler, judge_config(reply_format=reply_format))
    with pytest.raises(JudgeRequestRefused, match=r"refused the request \(HTTP 400\)") as caught:
        await grader.grade(MATH_TASK, "x")
    assert ("reply_format = 'free_text'" in str(caught.value)) == (reply_format == "structured")


@pytest.mark.parametrize("status", [408, 429, 503])
async def test_http_errors_propagate_for_a_retry(status: int) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, text="overloaded")

    grader, _ = judge_with(handler)
    with pytest.raises(httpx.HTTPStatusError):
        await grader.grade(MATH_TASK, "x")


async def test_judge_keeps_to_its_concurrency() -> None:
    in_flight, most = 0, 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return chat_reply("SCORE: 10")

    grader, seen = judge_with(handler)  # concurrency=2
    results = await asyncio.gather(*(grader.grade(MATH_TASK, str(i)) for i in range(6)))
    assert [r.score for r in results] == [1.0] * 6 and len(seen) == 6 and most == 2


def test_judge_version_follows_every_setting() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError

    versions = {
        judge_with(handler, config)[0].version
        for config in (judge_config(), judge_config(model="other"), judge_config(max_score=5.0), judge_config())
    }
    assert len(versions) == 3


@pytest.mark.parametrize(
    ("base_url", "api", "url"),
    [
        ("http://j:8000", "chat", "http://j:8000/v1/chat/completions"),
        ("http://j:8000/v1/", "completions", "http://j:8000/v1/completions"),
        ("https://api.example.com/openai/v1", "chat", "https://api.example.com/openai/v1/chat/completions"),
    ],
)
def test_endpoint_url(base_url: str, api: str, url: str) -> None:
    assert endpoint_url(base_url, api) == url


def test_judge_config_messages_name_the_field_and_the_fix() -> None:
    base = {"base_url": "http://j:8000", "model": "m"}
    with pytest.raises(ValidationError, match=r"judge.prompt_template uses unknown fields \['answer'\]"):
        JudgeConfig(**base, prompt_template="{answer} {response}")
    with pytest.raises(ValidationError, match=r"never shows the response: add \{response\}"):
        JudgeConfig(**base, prompt_template="{question}")
    with pytest.raises(ValidationError, match="score_pattern has 0 groups"):
        JudgeConfig(**base, score_pattern=r"SCORE: \d+")
    with pytest.raises(ValidationError, match="has no scheme"):
        JudgeConfig(base_url="judge:8000", model="m")
    with pytest.raises(ValidationError, match="grader.judge is required when grader.name is 'judge'"):
        GraderConfig(name="judge")
    with pytest.raises(ValueError, match="judge.api_key_env names 'NOPE_UNSET', which is not set"):
        build_grader("judge", judge_config(api_key_env="NOPE_UNSET"), GraderDeps())


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("score", "details", "reason"),
    [
        (math.nan, {}, "the score is not finite"),
        (math.inf, {}, "the score is not finite"),
        (-math.inf, {}, "the score is not finite"),
        (-0.1, {}, r"the score is outside \[0.0, 1.0\]"),
        (1.0001, {}, r"the score is outside \[0.0, 1.0\]"),
        ("0.5", {}, "the score is not a number"),
        (True, {}, "the score is not a number"),
        (0.5, {"x": math.nan}, "the details are not JSON"),
        (0.5, {"x": {1, 2}}, "the details are not JSON"),
    ],
)
def test_invalid_grades_are_rejected_by_name_and_value(score: object, details: dict, reason: str) -> None:
    with pytest.raises(InvalidGrade, match=f"grader 'g' produced an invalid grade .*: {reason}") as caught:
        validate_grade("g", GradeResult(score, details))  # type: ignore[arg-type]
    assert caught.value.grader == "g"


def test_valid_grades_pass_as_floats() -> None:
    assert validate_grade("g", GradeResult(1, {"a": [1]})) == GradeResult(1.0, {"a": [1]})
    assert isinstance(validate_grade("g", GradeResult(0, {})).score, float)


# --- cache ---------------------------------------------------------------------------------------


def test_cache_key_is_sha256_of_canonical_json() -> None:
    expected_bytes = (
        b'{"grader":"answer_match","prompt":{"metadata":{},"question":"What is 12 * 7?","reference":"84"},'
        b'"response":"<answer>84</answer> \xc3\xa9","version":"1"}'
    )
    key = grade_cache_key("answer_match", "1", MATH_TASK, "<answer>84</answer> é")
    assert key == hashlib.sha256(expected_bytes).hexdigest()
    assert canonical_json({"b": 1, "a": [1.5, None]}) == b'{"a":[1.5,null],"b":1}'


def test_cache_key_changes_with_each_part_but_not_the_task_id() -> None:
    key = grade_cache_key("answer_match", "1", MATH_TASK, "r")
    same_content = Task(id="other:9", split="train", index=9, question=MATH_TASK.question, reference="84")
    assert grade_cache_key("answer_match", "1", same_content, "r") == key
    others = {
        grade_cache_key("judge", "1", MATH_TASK, "r"),
        grade_cache_key("answer_match", "2", MATH_TASK, "r"),
        grade_cache_key("answer_match", "1", MATH_TASK, "r "),
        grade_cache_key("answer_match", "1", Task("t:0", "eval", 0, MATH_TASK.question, "85"), "r"),
        grade_cache_key("answer_match", "1", CODE_TASK, "r"),
    }
    assert key not in others and len(others) == 5


async def test_lru_evicts_the_least_recently_used() -> None:
    cache = InMemoryGradeCache(max_entries=2)
    await cache.put("a", GradeResult(1.0, {"n": 1}))
    await cache.put("b", GradeResult(0.0))
    assert await cache.get("a") == GradeResult(1.0, {"n": 1})  # a is now the most recent
    await cache.put("c", GradeResult(0.5))
    assert await cache.get("b") is None and len(cache) == 2
    hit = await cache.get("a")
    hit.details["n"] = 99  # callers cannot reach into the cache
    assert (await cache.get("a")).details == {"n": 1}


class CountingGrader(Grader):
    name = "counting"
    version = "1"

    def __init__(self, score: float) -> None:
        self.calls, self._score = 0, score

    async def score(self, task: Task, response_text: str) -> GradeResult:
        self.calls += 1
        return GradeResult(self._score, {"len": len(response_text)})


async def test_grade_with_cache_misses_then_hits() -> None:
    grader, cache = CountingGrader(0.25), InMemoryGradeCache()
    assert await grade_with_cache(grader, cache, MATH_TASK, "abc") == (GradeResult(0.25, {"len": 3}), False)
    assert await grade_with_cache(grader, cache, MATH_TASK, "abc") == (GradeResult(0.25, {"len": 3}), True)
    assert await grade_with_cache(grader, cache, MATH_TASK, "abcd") == (GradeResult(0.25, {"len": 4}), False)
    assert grader.calls == 2


async def test_invalid_grades_are_not_cached() -> None:
    grader, cache = CountingGrader(math.nan), InMemoryGradeCache()
    with pytest.raises(InvalidGrade, match="grader 'counting' produced an invalid grade nan"):
        await grade_with_cache(grader, cache, MATH_TASK, "abc")
    assert len(cache) == 0


# --- registry ------------------------------------------------------------------------------------


def test_unknown_grader_lists_the_known_ones() -> None:
    known = "known graders: answer_match, code_tests, final_number, judge, verifiers_rubric"
    with pytest.raises(UnknownGrader, match=f"unknown grader 'bleu'; {known}"):
        GRADERS.get("bleu")
    with pytest.raises(ValidationError, match="grader.name 'bleu' is not a registered grader"):
        GraderConfig(name="bleu")


def test_rubric_graders_come_from_the_env_unless_the_config_names_one() -> None:
    env_rubric = Rubric({"answer_match": 1.0})
    rubric, graders = build_rubric_graders(env_rubric, GraderConfig(), GraderDeps())
    assert rubric is env_rubric and isinstance(graders["answer_match"], AnswerMatchGrader)
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: chat_reply("SCORE: 1")))
    rubric, graders = build_rubric_graders(env_rubric, judge_config(), GraderDeps(http_client=client))
    assert dict(rubric.weights) == {"judge": 1.0} and list(graders) == ["judge"]


def test_every_invalid_grade_type_is_not_retried() -> None:
    """Temporal's retry policy matches an error's own class name, not its bases."""
    import rlpipe.graders.judge  # noqa: F401 - defines subclasses
    import rlpipe.graders.rules  # noqa: F401
    from rlpipe.workflows.policies import NON_RETRYABLE

    def subclasses(cls: type) -> set[type]:
        return {cls} | {sub for direct in cls.__subclasses__() for sub in subclasses(direct)}

    assert {cls.__name__ for cls in subclasses(InvalidGrade)} <= set(NON_RETRYABLE)
