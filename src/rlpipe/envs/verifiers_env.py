"""The 'verifiers' environment: an installed `verifiers` environment, played by rlpipe's own rollout loop.

    [env]
    name = "verifiers"
    [env.verifiers]
    id = "vf-sums"                 # the installed environment (envs.verifiers_load: what loads, what is refused)
    args = {max_operand = 5}       # its taskset's config fields

The taskset's tasks are the prompts (the eval ones carved off by a hash of each task's key and env.seed,
none also trained on; the train ones in an order drawn from env.seed). A task's system prompt and prompt
open the conversation. Its tools are called in rlpipe's tag protocol (envs.toolcalls) with a JSON object
of arguments, `<calculator_add>{"a": 2, "b": 3}</calculator_add>`, which the system prompt explains (a
text model has no other way to see tool schemas); the episode ends at a reply without a tool call, or at
env.max_turns (4 with tools, 1 without). The rubric is the task's: the grader `verifiers_rubric` scores the
whole conversation with its `@vf.reward` functions in the grader box (graders.verifiers_rubric).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import random
from typing import Any

from rlpipe.envs.base import SPLITS, ChatMessage, Environment, Executor, Problem, Rubric, Split, Task, ToolResult
from rlpipe.envs.toolcalls import ANSWER_TAG, Action, ToolCall, close_tag, parse_action
from rlpipe.envs.verifiers_load import LoadedTaskset, ToolSpec, VerifiersError, load_taskset, prompt_messages
from rlpipe.schemas.task import EnvConfig
from rlpipe.schemas.verifiers import VerifiersConfig

DEFAULT_EVAL_FRACTION = 10  # without eval_tasks, one task in ten is carved off for eval
DEFAULT_TOOL_TURNS = 4


def tools_prompt(tools: list[ToolSpec]) -> str:
    """How the model calls `tools`, appended to the task's system prompt."""
    example = tools[0]
    arguments = json.dumps({name: "..." for name in example.parameters})
    lines = ["You can call tools. Call one by writing its name as a tag around a JSON object of its arguments, "
             f"for example <{example.name}>{arguments}</{example.name}>, and you will be shown its result. "
             "Answer without a tool call when you are done.", "Tools:"]
    lines += [f"- {spec.signature()}: {spec.description}".rstrip(": ") for spec in tools]
    return "\n".join(lines)


def tool_arguments(spec: ToolSpec, text: str) -> dict[str, Any]:
    """The keyword arguments of a call to `spec` written as `text`: a JSON object, or for a tool of one
    parameter the bare text; ValueError, in words the model can act on, for anything else."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        if len(spec.parameters) == 1:
            return {spec.parameters[0]: text}
        raise ValueError(f"the arguments of {spec.name} must be a JSON object with "
                         f"{', '.join(map(repr, spec.parameters)) or 'no keys'}")
    unknown = sorted(set(value) - set(spec.parameters))
    missing = [name for name in spec.required if name not in value]
    if unknown or missing:
        raise ValueError(f"{spec.signature()} got " + "; ".join(
            part for part in (unknown and f"unknown arguments {unknown}", missing and f"no {missing}") if part))
    return value


def carve(keys: list[str], seed: int, eval_count: int) -> tuple[list[int], list[int]]:
    """(train positions, eval positions) of tasks with `keys`: the `eval_count` tasks with the smallest
    hash of (seed, key) are eval; the rest, in an order drawn from (seed, key), train. The same in every
    process, whatever order the taskset yields them in."""
    def order(salt: str) -> list[int]:
        return sorted(range(len(keys)), key=lambda i: hashlib.sha256(f"{seed}/{salt}/{keys[i]}".encode()).digest())

    evals = order("eval")[:eval_count]
    chosen = set(evals)
    return [i for i in order("train") if i not in chosen], evals


class VerifiersEnv(Environment):
    """A `verifiers` environment's tasks, tools and rubric behind rlpipe's Environment interface."""

    name = "verifiers"
    system_prompt = ""  # each task's own
    rubric = Rubric({"verifiers_rubric": 1.0})

    def __init__(self, config: EnvConfig) -> None:
        super().__init__(config)
        if config.verifiers is None:
            raise ValueError(f"environment {self.name!r} needs env.verifiers (at least its id)")
        self.loaded: LoadedTaskset = load_taskset(config.verifiers)
        self.tool_specs = list(self.loaded.tools.values())
        self.max_turns = config.max_turns or (DEFAULT_TOOL_TURNS if self.tool_specs else 1)
        cfg = config.verifiers
        n = len(self.loaded.tasks)
        eval_count = cfg.eval_tasks if cfg.eval_tasks is not None else max(1, n // DEFAULT_EVAL_FRACTION)
        if eval_count >= n:
            raise VerifiersError(f"verifiers environment {cfg.id!r}: env.verifiers.eval_tasks is {eval_count}, but "
                                 f"it has only {n} tasks and training needs at least one: lower eval_tasks")
        train, evals = carve([task.key for task in self.loaded.tasks], config.seed, eval_count)
        self.positions: dict[Split, list[int]] = {"train": train, "eval": evals}

    @property
    def verifiers_config(self) -> VerifiersConfig:
        assert self.config.verifiers is not None  # checked in __init__
        return self.config.verifiers

    def _positions(self, split: Split) -> list[int]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: use one of {SPLITS}")
        return self.positions[split]

    def size(self, split: Split) -> int:
        return len(self._positions(split))

    def task(self, split: Split, index: int) -> Task:
        positions = self._positions(split)
        if not 0 <= index < len(positions):
            raise IndexError(f"{split} index {index} is outside 0..{len(positions) - 1} of env {self.name!r}")
        return self._task(split, index, positions[index])

    def _task(self, split: Split, index: int, position: int) -> Task:
        from verifiers.v1.task import TaskData

        vf_task = self.loaded.tasks[position]
        data = vf_task.data
        # the task's own fields (beyond verifiers' common ones) stand for the reference a judge would be shown
        own = data.model_dump(mode="json", exclude=set(TaskData.model_fields))
        cfg = self.verifiers_config
        # the metadata is part of every grade's cache key: the environment, its args and its rubric's code
        metadata = {"verifiers": {"id": cfg.id, "args": cfg.args, "max_tasks": cfg.max_tasks, "position": position,
                                  "key": vf_task.key, "rubric": self.loaded.rubric_version}}
        return Task(id=f"{self.name}:{self.config.seed}:{split}:{index}", split=split, index=index,
                    question=data.prompt_text, reference=json.dumps(own, sort_keys=True), metadata=metadata)

    def sample_problem(self, rng: random.Random) -> Problem:
        """A train task drawn with `rng` (the splits themselves are fixed by the taskset, not drawn)."""
        task = self._task("train", 0, rng.choice(self.positions["train"]))
        return Problem(task.question, task.reference, task.metadata)

    def initial_messages(self, task: Task) -> list[ChatMessage]:
        position = task.metadata["verifiers"]["position"]
        messages = prompt_messages(self.verifiers_config.id, self.loaded.tasks[position].data)
        if not self.tool_specs:
            return messages
        if messages and messages[0]["role"] == "system":
            system = {"role": "system", "content": f"{messages[0]['content']}\n\n{tools_prompt(self.tool_specs)}"}
            return [system, *messages[1:]]  # type: ignore[list-item]  # a ChatMessage literal
        return [{"role": "system", "content": tools_prompt(self.tool_specs)}, *messages]

    # --- tools: the toolsets' @vf.tool methods, called with the model's JSON arguments ----------------

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return tuple(close_tag(name) for name in (ANSWER_TAG, *self.loaded.tools))

    def step(self, task: Task, model_text: str) -> Action:
        return parse_action(model_text, tuple(self.loaded.tools), self.config.max_tool_calls_per_turn)

    async def run_tool(self, call: ToolCall, executor: Executor) -> ToolResult:
        if call.error is not None:
            return ToolResult(ok=False, output="", reason=call.error)
        spec = self.loaded.tools.get(call.name)
        if spec is None:
            return ToolResult(ok=False, output="", reason=f"unknown tool {call.name!r}; tools: "
                                                          f"{', '.join(self.loaded.tools) or 'none'}")
        try:
            arguments = tool_arguments(spec, call.arguments)
        except ValueError as exc:
            return ToolResult(ok=False, output="", reason=str(exc))
        try:
            if inspect.iscoroutinefunction(spec.method):
                result = await spec.method(**arguments)
            else:  # a plain function runs in a thread: a slow one must not stall the worker's event loop
                result = await asyncio.to_thread(spec.method, **arguments)
        except Exception as exc:  # noqa: BLE001 - the tool's own error (a bad argument type) is the model's to see
            return ToolResult(ok=False, output="", reason=f"{type(exc).__name__}: {exc}")
        return ToolResult(ok=True, output=result if isinstance(result, str) else json.dumps(result, default=str))
