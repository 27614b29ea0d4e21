"""Demonstration chats of an environment: the text a small model is warmed up on so that it
starts RL able to follow the task's format (and, for tool tasks, to call the tool).

A demonstration is rendered exactly as a rollout will show it to the model, token for token:
the ChatML prompt of `initial_messages`, the assistant's reply, and for a tool call the
observation as the rollout appends it (close the assistant turn, a `tool` message, a new
assistant header). Some replies are wrong or malformed on purpose, so that sampled answers
differ within a group and RL has a signal from the first step.
"""

from __future__ import annotations

import random

from rlpipe.envs.base import ChatMessage, Environment
from rlpipe.envs.toolcalls import ANSWER_TAG, close_tag, open_tag

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
WRONG_ANSWER_RATE = 0.3
MALFORMED_RATE = 0.1


def chatml(messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def answer(value: str) -> str:
    return f"{open_tag(ANSWER_TAG)}{value}{close_tag(ANSWER_TAG)}"


def noisy_answer(reference: str, rng: random.Random) -> str:
    """The right answer, a near miss, or a malformed one."""
    roll = rng.random()
    if roll < WRONG_ANSWER_RATE and reference.lstrip("-").isdigit():
        return answer(str(int(reference) + rng.choice((-10, -2, -1, 1, 2, 10))))
    if roll < WRONG_ANSWER_RATE + MALFORMED_RATE:
        return rng.choice((reference, f"{open_tag(ANSWER_TAG)}{reference}", f"answer {reference}"))
    return answer(reference)


def demonstration(env: Environment, index: int, rng: random.Random) -> str:
    """One rendered episode of train task `index`: a direct answer, or for an environment with a
    single tool, a tool call first when the environment has one."""
    task = env.task("train", index % env.size("train"))
    text = chatml(env.initial_messages(task))
    if env.tools and rng.random() < 0.7:
        tool = env.tools[0]
        expression = task.metadata.get("expression", task.question)
        text += f"{open_tag(tool)}{expression}{close_tag(tool)}{IM_END}\n"
        text += chatml([{"role": "tool", "content": task.reference}])
    return text + noisy_answer(task.reference, rng) + IM_END


def demonstrations(env: Environment, count: int, seed: int = 0) -> list[str]:
    rng = random.Random(f"demonstrations/{env.name}/{seed}")
    return [demonstration(env, i, rng) for i in range(count)]
