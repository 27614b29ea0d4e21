"""Loading an installed `verifiers` environment (0.4, `verifiers.v1`) for rlpipe to play, and refusing what
rlpipe cannot play exactly.

A `verifiers` environment is a taskset package: its module (the id with '-' as '_') exports a `Taskset`
whose tasks carry a prompt, a system prompt, tool servers (`Toolset`s with `@vf.tool` methods) and a rubric
(`@vf.reward` methods over the episode's trace). `verifiers` plays a task by launching a harness program
that calls the model through an OpenAI-compatible proxy; rlpipe plays it itself instead, turn by turn
through its own generation activities (token ids and logprobs as sampled, the policy version of every
token), calling the toolsets' methods in its sandbox worker and the rubric in its grader box. What that
replaces is `verifiers`' plain chat loop (its `null` harness: chat with the task's tools, no shell).

Refused, each by name (`VerifiersFeatureError`), because rlpipe could not play it token-exactly or at all:
a bundled harness (its own program calls the model and may rewrite or compact earlier turns), a bundled
`Env` (its own episode logic: several agents, a simulated user), `@vf.intercept` hooks (they rewrite
requests and responses, so the trained tokens would not be the sampled ones), `@vf.stop` hooks (they read
verifiers' request objects), judges (an LLM called outside rlpipe), rewards or metrics that need a runtime
box, tasks that need a container, stateful or set-up toolsets, and prompts that are not plain text.

This module imports `verifiers` only when a run uses it: `import rlpipe` stays free of it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import validate_call

from rlpipe.envs.base import ChatMessage
from rlpipe.schemas.verifiers import MAX_TASKS, VerifiersConfig

PROMPT_ROLES = ("system", "user", "assistant")
_REQUIRES_VERIFIERS = re.compile(r"\s*verifiers(?![\w.-])", re.IGNORECASE)


class VerifiersError(ValueError):
    """A `verifiers` environment that cannot be loaded, or whose config or data is wrong."""


class VerifiersFeatureError(VerifiersError):
    """A `verifiers` feature that rlpipe refuses, named, with the reason (see the module docstring)."""

    def __init__(self, env_id: str, feature: str, why: str) -> None:
        self.feature = feature
        super().__init__(f"verifiers environment {env_id!r} uses {feature}, which rlpipe refuses: {why} "
                         "(docs/own-tasks.md, 'verifiers environments')")


@dataclass(frozen=True)
class ToolSpec:
    """One `@vf.tool` method as the model calls it: `<name>{json arguments}</name>`."""

    name: str  # "<server>_<tool>", verifiers' own name for an MCP tool of a server
    description: str
    parameters: tuple[str, ...]
    required: tuple[str, ...]
    method: Callable[..., Any]

    def signature(self) -> str:
        return f"{self.name}({', '.join(self.parameters)})"


@dataclass(frozen=True)
class LoadedTaskset:
    """What one process loads once per config: the taskset, its tasks in order, and the tools they use."""

    config: VerifiersConfig
    taskset: Any  # verifiers.v1.Taskset
    tasks: list[Any]  # verifiers.v1.Task, in the taskset's order
    tools: dict[str, ToolSpec]
    rubric_version: str  # changes when the rubric's code changes: part of every grade's cache key


_LOADED: dict[str, LoadedTaskset] = {}


def _cache_key(config: VerifiersConfig) -> str:
    return json.dumps([config.id, config.args, config.max_tasks], sort_keys=True, default=str)


def load_taskset(config: VerifiersConfig) -> LoadedTaskset:
    """The environment `config` names, loaded and checked (once per process and config)."""
    key = _cache_key(config)
    if key not in _LOADED:
        _LOADED[key] = _load(config)
    return _LOADED[key]


def installed_environments() -> list[str]:
    """The ids of installed packages that depend on `verifiers` (Hub environments do): each top-level
    module of theirs, with '_' as '-'."""
    ids: set[str] = set()
    for dist in importlib.metadata.distributions():
        if not any(_REQUIRES_VERIFIERS.match(requirement) for requirement in dist.requires or ()):
            continue
        for file in dist.files or ():
            if len(file.parts) == 2 and file.name == "__init__.py" and file.parts[0].isidentifier():
                ids.add(file.parts[0].replace("_", "-"))
    return sorted(ids)


def _load(config: VerifiersConfig) -> LoadedTaskset:
    try:
        from verifiers.v1.envs.single_agent import SingleAgentEnv
        from verifiers.v1.utils.loaders import default_harness_id, environment_class, taskset_class, taskset_config_type
    except ImportError as exc:
        raise VerifiersError(f"env.name 'verifiers' needs the verifiers package ({exc}): pip install "
                             "verifiers==0.4.0 where rlpipe and its workers run") from exc
    env_id = config.id
    importlib.invalidate_caches()  # a package installed since this process started is found too
    try:
        cls = taskset_class(env_id)
    except Exception as exc:  # noqa: BLE001 - a package's import may raise anything; its message says why
        installed = ", ".join(installed_environments()) or "none"
        raise VerifiersError(f"verifiers environment {env_id!r} cannot be loaded: {type(exc).__name__}: {exc} "
                             f"(installed verifiers environments: {installed}; install it where rlpipe and its "
                             "workers run)") from exc
    if environment_class(env_id) is not SingleAgentEnv:
        raise VerifiersFeatureError(env_id, "an Env of its own (its own episode logic: several agents, a "
                                    "simulated user)", "rlpipe plays one policy against the task's tools")
    if default_harness_id(env_id) != "bash":  # "bash" is what a taskset without a harness of its own gets
        raise VerifiersFeatureError(env_id, "a harness of its own (a program that calls the model itself)",
                                    "its model calls would bypass rlpipe's generation, and a harness may "
                                    "rewrite or compact earlier turns, so the trained tokens would not be the "
                                    "sampled ones")
    try:
        ts_config = taskset_config_type(env_id).model_validate({"id": env_id, **config.args})
    except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError names the field
        raise VerifiersError(f"verifiers environment {env_id!r}: env.verifiers.args do not fit its "
                             f"{taskset_config_type(env_id).__name__}: {exc}") from exc
    taskset = cls(ts_config)
    task_cls = cls.task_type()
    if task_cls.NEEDS_CONTAINER:
        raise VerifiersFeatureError(env_id, f"tasks that need a container ({task_cls.__name__}.NEEDS_CONTAINER)",
                                    "rlpipe runs tools in its own sandbox, not in a verifiers runtime")
    if taskset.INFINITE and config.max_tasks is None:
        raise VerifiersError(f"verifiers environment {env_id!r} has an infinite taskset: set "
                             "env.verifiers.max_tasks to the number of tasks to read")
    limit = config.max_tasks or MAX_TASKS
    tasks = list(itertools.islice(iter(taskset), limit + 1))
    if len(tasks) > limit:
        if config.max_tasks is None:
            raise VerifiersError(f"verifiers environment {env_id!r} has more than {MAX_TASKS} tasks: set "
                                 "env.verifiers.max_tasks to read its first ones")
        tasks = tasks[:limit]
    if len(tasks) < 2:
        raise VerifiersError(f"verifiers environment {env_id!r} has {len(tasks)} task(s): training and held-out "
                             "evaluation need at least two")
    first = tasks[0]
    check_scoring(env_id, first)
    keys: dict[str, int] = {}
    for position, task in enumerate(tasks):
        prompt_messages(env_id, task.data)  # refuses what is not plain text, at load rather than mid-run
        if keys.setdefault(task.key, position) != position:
            raise VerifiersError(f"verifiers environment {env_id!r}: tasks {keys[task.key]} and {position} have "
                                 f"the same key {task.key[:16]!r}: every task must be one prompt")
    toolsets = [*type(taskset).toolsets(ts_config), *task_cls.toolsets(first.config)]
    return LoadedTaskset(config, taskset, tasks, tool_specs(env_id, toolsets), rubric_version(first))


def check_scoring(env_id: str, task: Any) -> None:
    """Refuse the scoring and control features of `task` that rlpipe cannot run (module docstring)."""
    from verifiers.v1.utils.decorators import discover_decorated

    if discover_decorated(task, "intercept"):
        raise VerifiersFeatureError(env_id, "@vf.intercept hooks", "they rewrite model requests and responses, "
                                    "so the trained tokens would not be the ones sampled")
    if task.hooks("stop"):
        raise VerifiersFeatureError(env_id, "@vf.stop hooks", "rlpipe ends an episode when the model answers "
                                    "without a tool call, or at env.max_turns")
    if task.config.judges:
        raise VerifiersFeatureError(env_id, "judges (task.config.judges)", "a judge calls a model outside "
                                    "rlpipe; grade with rlpipe's judge grader instead (grader.name = 'judge')")
    signals = [*task.hooks("reward"), *task.hooks("metric")]
    needs_runtime = [fn.__name__ for fn in signals if "runtime" in inspect.signature(fn).parameters]
    if needs_runtime:
        raise VerifiersFeatureError(env_id, f"rewards or metrics that read a runtime box ({', '.join(needs_runtime)})",
                                    "rlpipe's grader box scores the trace without a verifiers runtime")
    if not task.hooks("reward"):
        raise VerifiersError(f"verifiers environment {env_id!r} has no @vf.reward: nothing to train on")


def rubric_version(task: Any) -> str:
    """A hash of the code that scores `task` (its class, its reward and metric functions): a grade cached
    for one version of the rubric is not reused for another."""
    sources = []
    for obj in (type(task), *task.hooks("reward"), *task.hooks("metric")):
        try:
            sources.append(inspect.getsource(obj))
        except (OSError, TypeError):
            sources.append(f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}")
    return hashlib.sha256("\n".join(sources).encode()).hexdigest()[:12]


def tool_specs(env_id: str, toolsets: list[Any]) -> dict[str, ToolSpec]:
    """The `@vf.tool` methods of `toolsets` by the name the model calls them by; refuses toolsets whose
    state or set-up lives in a verifiers tool server (rlpipe calls each method on its own, in any worker)."""
    from verifiers.v1.mcp import Toolset
    from verifiers.v1.state import State
    from verifiers.v1.utils.decorators import discover_decorated

    specs: dict[str, ToolSpec] = {}
    for toolset in toolsets:
        kind = type(toolset).__name__
        if not isinstance(toolset, Toolset):
            raise VerifiersFeatureError(env_id, f"a tool server that is not a Toolset ({kind})",
                                        "rlpipe calls @vf.tool methods, not other MCP servers")
        if toolset._state_cls is not State:
            raise VerifiersFeatureError(env_id, f"a stateful toolset ({kind}, state {toolset._state_cls.__name__})",
                                        "each tool call is an activity of its own, possibly on another worker, "
                                        "with no rollout state channel")
        overridden = [hook for hook in ("setup", "setup_task")
                      if getattr(type(toolset), hook) is not getattr(Toolset, hook)]
        if overridden:
            raise VerifiersFeatureError(env_id, f"toolset set-up hooks ({kind}.{', '.join(overridden)})",
                                        "rlpipe does not run a tool server, only its @vf.tool methods")
        for method in discover_decorated(toolset, "tool"):
            tool = getattr(method, "tool_name", None) or method.__name__
            name = f"{toolset.server_name}_{tool}" if toolset.server_name else tool
            params = [p for p in inspect.signature(method).parameters.values()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            if name in specs:
                raise VerifiersError(f"verifiers environment {env_id!r}: two tools are called {name!r}")
            # validated by its annotations, as verifiers' MCP server validates a call's arguments
            specs[name] = ToolSpec(name, inspect.cleandoc(method.__doc__ or ""), tuple(p.name for p in params),
                                   tuple(p.name for p in params if p.default is p.empty), validate_call(method))
    return specs


def prompt_messages(env_id: str, data: Any) -> list[ChatMessage]:
    """The system prompt and the prompt of a task's data as chat messages (what verifiers' chat loop sends
    first), or VerifiersFeatureError for content that is not plain text (images) or tool messages."""
    messages: list[ChatMessage] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    prompt = data.prompt
    if prompt is None:
        raise VerifiersError(f"verifiers environment {env_id!r}: task {data.idx} has no prompt")
    if isinstance(prompt, str):
        return [*messages, {"role": "user", "content": prompt}]
    for message in prompt:
        role, content = message.role, message.content
        if role not in PROMPT_ROLES or getattr(message, "tool_calls", None):
            raise VerifiersFeatureError(env_id, f"a prompt with {role} messages or tool calls (task {data.idx})",
                                        "rlpipe's prompts are system, user and assistant text")
        if not isinstance(content, str):
            raise VerifiersFeatureError(env_id, f"prompt content that is not text (task {data.idx}: "
                                        f"{type(content).__name__})", "rlpipe trains on text models")
        messages.append({"role": role, "content": content})
    return messages
