"""Greedy held-out evaluation of the policy an inference server holds.

Each eval prompt is played as one greedy episode, token in and token out like a rollout (tool
calls run, observations appended as ids), and graded by the run's rubric. Accuracy is the share
of episodes with reward 1; the 95% interval is Wilson's, which behaves at 0% and 100% where the
normal approximation does not.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

from rlpipe.envs.base import Environment, Executor, Rubric, Task
from rlpipe.envs.toolcalls import ToolCalls, to_clean_text
from rlpipe.graders.base import Grader
from rlpipe.graders.conversation import Message, assistant_message, conversation_text, tool_message
from rlpipe.inference.client import InferenceClient
from rlpipe.policy.chat import chat_prompt_ids
from rlpipe.rollout.tokens import observation_ids


@dataclass(frozen=True)
class EvalOutcome:
    n_prompts: int
    n_correct: int
    mean_reward: float
    served_versions: list[str] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.n_correct / self.n_prompts

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.n_correct, self.n_prompts)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class GreedyEpisode:
    text: str  # the final model message
    version: str  # the weight version label of the server that played it
    messages: list[Message]  # the whole episode, for graders that read it (graders.conversation)

    def graded_text(self, grader: Grader) -> str:
        return conversation_text(self.messages) if grader.reads_conversation else self.text


async def greedy_episode(client: InferenceClient, env: Environment, task: Task, tokenizer: Any, executor: Executor,
                         max_tokens: int, max_model_len: int) -> GreedyEpisode:
    """Play one episode greedily."""
    context = chat_prompt_ids(tokenizer, env.initial_messages(task))
    text, version = "", ""
    messages: list[Message] = []
    for turn in range(env.max_turns):
        budget = min(max_tokens, max_model_len - len(context))
        if budget < 1:
            break
        completion = await client.complete(context, max_tokens=budget, temperature=0.0,
                                           stop=list(env.stop_sequences), stop_token_ids=[tokenizer.eos_token_id])
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        version = completion.weight_version
        action = env.step(task, text)
        if not isinstance(action, ToolCalls) or turn + 1 == env.max_turns:
            messages.append(assistant_message(text, []))
            break
        results = [await env.run_tool(call, executor) for call in action.calls]
        messages.append(assistant_message(text, [(call.name, call.arguments) for call in action.calls]))
        messages += [tool_message(call.name, result.ok, to_clean_text(result.output), result.reason)
                     for call, result in zip(action.calls, results, strict=True)]
        observations = [env.observation(c, r) for c, r in zip(action.calls, results, strict=True)]
        context += completion.token_ids + observation_ids(tokenizer, observations)
    return GreedyEpisode(text, version, messages)


async def evaluate(client: InferenceClient, env: Environment, tokenizer: Any, executor: Executor, rubric: Rubric,
                   graders: dict[str, Grader], n_prompts: int, max_tokens: int, max_model_len: int,
                   concurrency: int = 32) -> EvalOutcome:
    """Accuracy of the served policy on the first `n_prompts` eval tasks of `env`."""
    limit = asyncio.Semaphore(concurrency)
    tasks = [env.task("eval", i) for i in range(min(n_prompts, env.size("eval")))]

    async def one(task: Task) -> tuple[float, str]:
        async with limit:
            episode = await greedy_episode(client, env, task, tokenizer, executor, max_tokens, max_model_len)
            scores = {name: (await grader.grade(task, episode.graded_text(grader))).score
                      for name, grader in graders.items()}
            return rubric.reward(scores), episode.version

    results = await asyncio.gather(*(one(t) for t in tasks))
    rewards = [r for r, _ in results]
    return EvalOutcome(n_prompts=len(rewards), n_correct=sum(r >= 1.0 for r in rewards),
                       mean_reward=sum(rewards) / len(rewards), served_versions=sorted({v for _, v in results}))


class WrongVersionServed(RuntimeError):
    """The server answered with other weights than the version under evaluation (a sync came in
    between, or it holds another version); the evaluation is retried or refused."""


async def evaluate_served_version(client: InferenceClient, env: Environment, tokenizer: Any, executor: Executor,
                                  rubric: Rubric, graders: dict[str, Grader], version: int, n_prompts: int,
                                  max_tokens: int, max_model_len: int) -> EvalOutcome:
    """`evaluate`, checking that every episode was played by `version` and nothing else."""
    served = await client.weight_version()
    if served != str(version):
        raise WrongVersionServed(f"{client.base_url} holds version {served}, not {version}: evaluate the version "
                                 "it serves, or sync the one you want first")
    outcome = await evaluate(client, env, tokenizer, executor, rubric, graders, n_prompts, max_tokens, max_model_len)
    if outcome.served_versions != [str(version)]:
        raise WrongVersionServed(f"{client.base_url} changed weights during the evaluation of version {version} "
                                 f"(saw {outcome.served_versions})")
    return outcome
