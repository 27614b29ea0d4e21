"""One model turn of a trajectory, token in and token out.

The context is the prompt and every earlier turn's ids, exactly as sampled; the observation of
the previous turn's tool calls is rendered once into ids (`input_ids` of this turn). The output
is parsed by the environment into tool calls (to run next) or the end of the episode.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import Any

from rlpipe.envs.base import Environment, Task, ToolResult
from rlpipe.envs.toolcalls import ToolCall, ToolCalls
from rlpipe.inference.client import Completion, InferenceClient, RequestRejectedError
from rlpipe.rollout.tokens import observation_ids
from rlpipe.schemas.config import RunConfig
from rlpipe.storage.buffer import TrajectoryContext


class ContextTooLong(ValueError):
    """The prompt alone does not fit the model's context; retrying cannot help."""


_SERVER_CONTEXT_LIMIT = re.compile(r"maximum (model|context) length")
"""vLLM's 400 for a prompt over its --max-model-len says "maximum model length" (generate route) or
"maximum context length" (completions route)."""


class UnpublishedWeights(RuntimeError):
    """The server sampled with weights that are no published version (being verified during a
    sync, or never synced): the sample is thrown away and the call retried."""


@dataclass(frozen=True)
class TurnPlan:
    input_ids: list[int]
    """Ids appended before this call (the prompt for turn 0, observations after)."""
    context_ids: list[int]
    """Everything the model sees: the prompt, earlier turns and `input_ids`."""


def plan_turn(ctx: TrajectoryContext, turn_index: int, env: Environment, tokenizer: Any) -> TurnPlan:
    """The token context of turn `turn_index`, built from the stored earlier turns."""
    if turn_index != len(ctx.turns):
        raise ValueError(f"trajectory {ctx.trajectory_id}: turn {turn_index} requested after {len(ctx.turns)} turns")
    context = list(ctx.prompt_ids)
    for turn in ctx.turns:
        context += (list(turn.input_ids) if turn.turn_index > 0 else []) + list(turn.output_ids)
    if turn_index == 0:
        return TurnPlan(list(ctx.prompt_ids), context)
    previous = ctx.turns[-1]
    observations = []
    for call in previous.tool_calls or []:
        result = call.get("result")
        if result is None:
            raise ValueError(f"trajectory {ctx.trajectory_id} turn {previous.turn_index}: tool call "
                             f"{call['name']} has no result yet")
        observations.append(env.observation(ToolCall(call["name"], call["arguments"], call.get("error")),
                                            ToolResult(result["ok"], result["output"], result.get("reason"))))
    added = observation_ids(tokenizer, observations)
    return TurnPlan(added, context + added)


async def sample_turn(client: InferenceClient, plan: TurnPlan, config: RunConfig, env: Environment,
                      tokenizer: Any, seed: int) -> tuple[Completion, float]:
    """Call the server for one turn; returns the completion (with its text decoded from the
    sampled ids: the token route returns none) and its latency in seconds."""
    budget = config.model.max_model_len - len(plan.context_ids)
    if budget < 1:
        raise ContextTooLong(f"the context has {len(plan.context_ids)} tokens, the model's limit is "
                             f"{config.model.max_model_len} (model.max_model_len)")
    started = time.monotonic()
    try:
        completion = await client.complete(
            plan.context_ids, max_tokens=min(config.sampling.max_tokens, budget),
            temperature=config.sampling.temperature, top_p=config.sampling.top_p, seed=seed,
            stop=list(env.stop_sequences), stop_token_ids=[tokenizer.eos_token_id])
    except RequestRejectedError as exc:
        if exc.status == 400 and _SERVER_CONTEXT_LIMIT.search(exc.body):  # a 400 would be retried in vain
            raise ContextTooLong(f"the context has {len(plan.context_ids)} tokens, more than the server's "
                                 f"context (model.max_model_len {config.model.max_model_len} is larger than the "
                                 f"server's --max-model-len): {exc}") from exc
        raise
    if completion.finish_reason == "abort":  # a sync paused the server in `abort` mode
        raise UnpublishedWeights(f"the request was aborted by a weight sync after {len(completion.token_ids)} "
                                 "tokens; it is retried on the new weights")
    text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    return dataclasses.replace(completion, text=text), time.monotonic() - started


def turn_row(ctx: TrajectoryContext, turn_index: int, plan: TurnPlan, completion: Completion, latency_s: float,
             server: str, env: Environment, task: Task, last_turn: bool) -> dict[str, Any]:
    """The `turns` row for a sampled turn, with the tool calls the environment parsed from it."""
    action = env.step(task, completion.text)
    calls = None
    if isinstance(action, ToolCalls) and not last_turn and completion.finish_reason != "length":
        calls = [{"name": c.name, "arguments": c.arguments, "error": c.error, "result": None} for c in action.calls]
    labels = [completion.weight_version, completion.last_weight_version,
              *(span.version for span in completion.weight_spans or ())]
    if not all(label.isdigit() for label in labels):
        raise UnpublishedWeights(f"server {server} sampled with weights labelled {sorted(set(labels))}, "
                                 "which are not all published versions")
    before, after = int(completion.weight_version), int(completion.last_weight_version)
    if completion.weight_spans:
        spans = [[int(span.version), span.start, span.end] for span in completion.weight_spans]
    else:  # bracketed by reads before and after the request: exact unless a sync happened during it
        spans = [[before, 0, len(completion.token_ids)]]
    return {
        "trajectory_id": ctx.trajectory_id, "turn_index": turn_index, "input_ids": plan.input_ids,
        "output_ids": completion.token_ids, "output_logprobs": completion.logprobs, "output_text": completion.text,
        "finish_reason": completion.finish_reason, "server": server, "version_before": before,
        "version_after": after, "version_spans": spans, "generate_latency_s": latency_s, "tool_calls": calls,
    }

