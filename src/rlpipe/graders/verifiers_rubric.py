"""The rubric of a `verifiers` environment as an rlpipe grader: its `@vf.reward` functions, run in the grader box.

The episode (graders.conversation) becomes the trace `verifiers` scores: the task's system prompt and
prompt, then the model's messages (with the tool calls it made) and the tools' results. `Task.score`
runs the task's rewards and metrics over it, exactly as `verifiers` would after its own rollout. Its
reward is the weighted sum of the rewards; rlpipe's rewards lie in [0, 1], so the grade is that sum over
the sum of the weights (the same number when the weights sum to 1, or for a single reward), and a rubric
whose rewards leave [0, 1] fails the group by name (graders.base). Each reward's score, its weight, the
sum and the metrics are kept in the grade's details.
"""

from __future__ import annotations

from typing import Any

from rlpipe.envs.base import ChatMessage, Task
from rlpipe.envs.verifiers_load import load_taskset, prompt_messages
from rlpipe.graders.base import Grader, GradeResult, InvalidGrade
from rlpipe.graders.conversation import Message, parse_conversation
from rlpipe.schemas.verifiers import VerifiersConfig


def episode_messages(episode: list[Message]) -> list[Any]:
    """The episode as `verifiers` messages; tool results answer the calls of the model message before them,
    in order (ids call_<message>_<call>)."""
    from verifiers.v1.types import AssistantMessage, ToolCall, ToolMessage

    messages: list[Any] = []
    pending: list[str] = []  # ids of the last model message's calls not yet answered
    for position, message in enumerate(episode):
        if message["role"] == "assistant":
            calls = [ToolCall(id=f"call_{position}_{i}", name=c["name"], arguments=c["arguments"])
                     for i, c in enumerate(message.get("tool_calls", ()))]
            messages.append(AssistantMessage(content=message["content"], tool_calls=calls or None))
            pending = [call.id for call in calls]
        else:
            if not pending:
                raise ValueError(f"conversation message {position}: a tool result answers no tool call")
            content = message["content"] if message["ok"] else \
                f"error: {message['error']}\n{message['content']}".rstrip()
            messages.append(ToolMessage(tool_call_id=pending.pop(0), name=message["name"], content=content))
    return messages


def episode_trace(vf_task: Any, prompt: list[ChatMessage], episode: list[Any]) -> Any:
    """A `verifiers` trace of `vf_task`: the prompt, then the `episode`'s messages (the model's marked as
    sampled, which is how `verifiers` tells its replies from prompt-supplied ones), as one branch."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage, SystemMessage, UserMessage

    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    opening = [(kinds[m["role"]](content=m["content"]), False) for m in prompt]
    played = [(m, m.role == "assistant") for m in episode]
    nodes = [MessageNode(parent=i - 1 if i else None, message=m, sampled=sampled)
             for i, (m, sampled) in enumerate(opening + played)]
    return Trace(task=TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash),
                 agent=AgentInfo(config=AgentConfig()), nodes=nodes, is_completed=True, ok=True)


class VerifiersRubricGrader(Grader):
    """The `@vf.reward` functions of the task's `verifiers` environment over the whole episode."""

    name = "verifiers_rubric"
    version = "1"  # the rubric's own code is hashed into each task's metadata, hence into every cache key
    reads_conversation = True

    async def score(self, task: Task, response_text: str) -> GradeResult:
        where = task.metadata.get("verifiers")
        if not isinstance(where, dict):
            raise ValueError(f"grader {self.name!r} grades tasks of env.name 'verifiers'; task {task.id} is not one")
        loaded = load_taskset(VerifiersConfig(id=where["id"], args=where["args"], max_tasks=where["max_tasks"]))
        vf_task = loaded.tasks[where["position"]]
        if vf_task.key != where["key"]:
            raise ValueError(f"task {task.id}: the verifiers environment {where['id']!r} installed here gives "
                             "another task at its position: every worker needs the same version of it")
        trace = episode_trace(vf_task, prompt_messages(where["id"], vf_task.data),
                              episode_messages(parse_conversation(response_text)))
        await vf_task.score(trace)
        rewards = {name: {"score": r.score, "weight": r.weight} for name, r in trace.rewards.items() if r is not None}
        unscored = sorted(name for name, r in trace.rewards.items() if r is None)
        if unscored:
            raise InvalidGrade(self.name, None, f"the rubric left {unscored} unscored")
        total_weight = sum(r["weight"] for r in rewards.values())
        if total_weight <= 0:
            raise InvalidGrade(self.name, rewards, "the rubric's weights do not sum to a positive number")
        details = {"rewards": rewards, "reward_sum": trace.reward,
                   "metrics": {name: value for name, value in trace.metrics.items() if value is not None}}
        return GradeResult(trace.reward / total_weight, details)
