"""The Environment protocol: what a task the policy acts in must provide, and the shared machinery.

Bring your own task by subclassing `Environment`; a run names it by import path
("my_pkg.tasks:LetterCount") or by the entry point of an installed package, and every worker finds it
(docs/own-tasks.md). Here it is registered in this process only, for the example. The rubric names
registered graders: `answer_match` compares the <answer> tag with an integer reference, so the
task's references are integers (this example runs as a test: tests/unit/test_envs.py):

>>> import asyncio
>>> import random
>>> from rlpipe.envs.base import Environment, Problem, Rubric
>>> from rlpipe.envs.registry import build_environment, register_environment
>>> from rlpipe.graders.rules import AnswerMatchGrader
>>> from rlpipe.schemas.task import EnvConfig
>>> WORDS = ("river", "lantern", "orbit", "meadow")
>>> @register_environment
... class LetterCount(Environment):
...     name = "letter_count"
...     system_prompt = "Count the letters of the word. Answer as <answer>N</answer>."
...     rubric = Rubric({"answer_match": 1.0})
...
...     def sample_problem(self, rng: random.Random) -> Problem:
...         word = rng.choice(WORDS)
...         return Problem(question=f"How many letters are in {word!r}?", reference=str(len(word)))
>>> env = build_environment(EnvConfig(name="letter_count", eval_size=2))
>>> task = env.task("train", 0)
>>> task.question, task.reference
("How many letters are in 'orbit'?", '5')
>>> asyncio.run(AnswerMatchGrader().grade(task, "<answer>5</answer>")).score
1.0

That is all a single-turn task needs. A multi-turn task also lists `tools` (tag names, see
`envs.toolcalls`) and implements `execute_tool`. The rollout loop is then:

    messages = env.initial_messages(task)          # chat-templated into prompt token ids
    for turn in range(env.max_turns):
        text = <generate with stop=env.stop_sequences, include_stop_str_in_output=True>
        action = env.step(task, text)
        if isinstance(action, Final): break
        for call in action.calls:                   # on the sandbox queue
            result = await env.run_tool(call, executor)
            tool_message = {"role": "tool", "content": env.observation(call, result)}
    reward = rubric over the graders, given the last model message

Environments are plain Python: no I/O, no clocks, no temporalio. Anything a tool must run in
isolation goes through the injected `Executor`, so the sandbox plugs in without the environment
knowing how it works.
"""

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, TypedDict

from rlpipe.envs.toolcalls import ANSWER_TAG, Action, ToolCall, close_tag, parse_action, to_clean_text, truncate_middle
from rlpipe.schemas.task import EnvConfig

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")

# Draws per train index before giving up on finding a question outside the eval set.
MAX_DRAWS = 100


class ChatMessage(TypedDict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


@dataclass(frozen=True)
class Problem:
    """What an environment draws: the question, its reference answer, and grader-facing metadata.

    Two problems with the same question are the same problem (that is how eval stays out of train).
    """

    question: str
    reference: str
    metadata: dict[str, Any] = field(default_factory=dict)  # JSON-friendly (hidden tests, ...)


@dataclass(frozen=True)
class Task:
    """One prompt of a split, addressable by (config, split, index) so payloads carry only the id."""

    id: str  # "<env>:<seed>:<split>:<index>"
    split: Split
    index: int
    question: str
    reference: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rubric:
    """Graders (by registry name) and their weights; the reward is the weighted sum of their scores."""

    weights: Mapping[str, float]

    def __post_init__(self) -> None:
        if not self.weights or any(w <= 0 for w in self.weights.values()):
            raise ValueError(f"a rubric needs graders with positive weights, got {dict(self.weights)}")

    def reward(self, scores: Mapping[str, float]) -> float:
        """Weighted mean of the graders' scores: [0, 1] scores give a [0, 1] reward."""
        missing = set(self.weights) - set(scores)
        if missing:
            raise ValueError(f"no score from rubric grader(s) {sorted(missing)}")
        total = sum(self.weights.values())
        return sum(w * scores[name] for name, w in self.weights.items()) / total


@dataclass(frozen=True)
class ToolResult:
    """What a tool produced. Not ok covers the model's mistakes (bad expression, timeout, syntax)."""

    ok: bool
    output: str | bytes
    reason: str | None = None  # why not ok, in words the model can act on


class ExecutionOutcome(Protocol):
    """One sandboxed run as the sandbox reports it (structural: the sandbox's result type fits as is)."""

    @property
    def status(self) -> str: ...  # "ok" when the program ran to completion; anything else is a failure

    @property
    def stdout(self) -> str | bytes: ...

    @property
    def stderr(self) -> str | bytes: ...

    @property
    def reason(self) -> str | None: ...


class Executor(Protocol):
    """The injected tool-execution boundary: run Python source in isolation.

    It returns an outcome for anything the code does (errors, timeouts, kills). When the sandbox
    itself fails it raises, or reports a status in SANDBOX_FAILURE_STATUSES; either way callers
    raise (`check_sandbox`), so infrastructure errors are retried instead of scored or shown.
    With `sandbox.Sandbox`, wire it as
    `lambda code, *, timeout_s: sandbox.run(code, limits=limits.model_copy(update={"wall_seconds": timeout_s}))`.
    """

    async def __call__(self, code: str, *, timeout_s: float) -> ExecutionOutcome: ...


# Statuses meaning the code never ran because isolation broke: not the model's doing.
SANDBOX_FAILURE_STATUSES = frozenset({"sandbox_error"})


class SandboxFailed(RuntimeError):
    """The executor could not run the code at all; retry the activity, never score or show this."""


def check_sandbox(outcome: ExecutionOutcome) -> ExecutionOutcome:
    """`outcome` if the code really ran (whatever it did), else SandboxFailed."""
    if outcome.status in SANDBOX_FAILURE_STATUSES:
        raise SandboxFailed(f"the sandbox could not run the code ({outcome.status}): {outcome.reason}")
    return outcome


class Environment(ABC):
    """A task family: deterministic prompt sets, the chat framing, tool dispatch, and a rubric."""

    name: ClassVar[str]
    system_prompt: ClassVar[str]
    rubric: ClassVar[Rubric]
    tools: ClassVar[tuple[str, ...]] = ()  # tag names the model may call, e.g. ("calc",)
    default_max_turns: ClassVar[int] = 1
    reads_dataset: ClassVar[bool] = False  # whether env.dataset means anything to it (envs.dataset)

    def __init__(self, config: EnvConfig) -> None:
        if config.dataset is not None and not self.reads_dataset:
            raise ValueError(f"env.dataset is set, but environment {self.name!r} reads no dataset: remove "
                             "env.dataset, or set env.name = 'dataset'")
        self.config = config
        self.max_turns = config.max_turns or self.default_max_turns
        self._eval_problems: list[Problem] | None = None  # drawn on first use, then reused
        self._eval_questions: frozenset[str] = frozenset()

    # --- prompt sets -------------------------------------------------------------------------

    @abstractmethod
    def sample_problem(self, rng: random.Random) -> Problem:
        """Draw one problem using only `rng` (so the draw is reproducible from the seed)."""

    def size(self, split: Split) -> int:
        return self.config.train_size if split == "train" else self.config.eval_size

    def task(self, split: Split, index: int) -> Task:
        """The `index`-th task of `split`: the same in every process for the same config.

        Eval problems are distinct from one another, and train never draws an eval question.
        """
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: use one of {SPLITS}")
        if not 0 <= index < self.size(split):
            raise IndexError(f"{split} index {index} is outside 0..{self.size(split) - 1} of env {self.name!r}")
        problem = self._eval_set()[index] if split == "eval" else self._train_problem(index)
        return Task(
            id=f"{self.name}:{self.config.seed}:{split}:{index}",
            split=split,
            index=index,
            question=problem.question,
            reference=problem.reference,
            metadata=problem.metadata,
        )

    def _rng(self, split: Split, index: int, draw: int) -> random.Random:
        # str seeds hash with sha512, so the stream does not depend on PYTHONHASHSEED or the process
        return random.Random(f"{self.name}/{self.config.seed}/{split}/{index}/{draw}")

    def _draw_avoiding(self, split: Split, index: int, taken: Set[str]) -> Problem:
        for draw in range(MAX_DRAWS):
            problem = self.sample_problem(self._rng(split, index, draw))
            if problem.question not in taken:
                return problem
        raise ValueError(
            f"env {self.name!r} found no new {split} question in {MAX_DRAWS} draws at index {index}: "
            f"its difficulty allows too few distinct questions for eval_size={self.config.eval_size}; "
            "widen the difficulty or lower eval_size"
        )

    def _eval_set(self) -> list[Problem]:
        if self._eval_problems is None:
            problems: list[Problem] = []
            taken: set[str] = set()
            for index in range(self.config.eval_size):
                problems.append(self._draw_avoiding("eval", index, taken))
                taken.add(problems[-1].question)
            self._eval_problems = problems
            self._eval_questions = frozenset(taken)
        return self._eval_problems

    def _train_problem(self, index: int) -> Problem:
        self._eval_set()
        return self._draw_avoiding("train", index, self._eval_questions)

    # --- the conversation --------------------------------------------------------------------

    def initial_messages(self, task: Task) -> list[ChatMessage]:
        """System and user messages that the rollout worker chat-templates into prompt token ids."""
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task.question}]

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        """Closing tags that end a generation; request them with include_stop_str_in_output=True,
        otherwise the closing tag is missing and the call reads as unterminated."""
        return tuple(close_tag(name) for name in (ANSWER_TAG, *self.tools))

    def step(self, task: Task, model_text: str) -> Action:
        """What the model's message asks for: tool calls to run, or the end of the episode."""
        return parse_action(model_text, self.tools, self.config.max_tool_calls_per_turn)

    async def run_tool(self, call: ToolCall, executor: Executor) -> ToolResult:
        """Run one call. Malformed calls and the model's own errors come back as a not-ok result;
        only a failing executor (infrastructure) raises."""
        if call.error is not None:
            return ToolResult(ok=False, output="", reason=call.error)
        if call.name not in self.tools:
            known = ", ".join(self.tools) or "none"
            return ToolResult(ok=False, output="", reason=f"unknown tool {call.name!r}; tools: {known}")
        return await self.execute_tool(call, executor)

    async def execute_tool(self, call: ToolCall, executor: Executor) -> ToolResult:
        """Run a well-formed call to one of `tools`; environments with tools override this."""
        raise NotImplementedError(f"env {self.name!r} lists tools {self.tools} but does not execute them")

    def observation(self, call: ToolCall, result: ToolResult) -> str:
        """Text of the tool message fed back to the model, at most max_observation_chars long."""
        text = to_clean_text(result.output)
        if not result.ok:
            text = f"error: {result.reason}\n{text}".rstrip()
        return truncate_middle(text, self.config.max_observation_chars)
