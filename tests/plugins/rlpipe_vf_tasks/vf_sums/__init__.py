"""vf-sums: "What is 3 + 4?", answered in one message, rewarded when its last integer is the sum.

A plain `verifiers` environment: a taskset of tasks, each scored by the task's own `@vf.reward`
methods over the trace (the conversation the model had)."""

import re
from collections.abc import Iterator

import verifiers.v1 as vf

LAST_INTEGER = re.compile(r"-?\d+")


class SumsData(vf.TaskData):
    answer: int


class SumsConfig(vf.TasksetConfig):
    max_operand: int = 9
    """Operands are 0..max_operand (load_environment's `args` set it: env.verifiers.args)."""


def last_integer(text: str) -> int | None:
    found = LAST_INTEGER.findall(text)
    return int(found[-1]) if found else None


class SumsTask(vf.Task[SumsData]):
    @vf.reward
    async def correct(self, task: SumsData, trace: vf.Trace) -> float:
        """1 when the reply's last integer is the sum."""
        return float(last_integer(trace.last_reply) == task.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        """Short replies: 1 up to 8 characters, less beyond."""
        return min(1.0, 8 / max(1, len(trace.last_reply.strip())))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self) -> Iterator[SumsTask]:
        n = self.config.max_operand + 1
        for a in range(n):
            for b in range(n):
                yield SumsTask(SumsData(id=f"{a}+{b}", prompt=f"What is {a} + {b}?", answer=a + b,
                                        system_prompt="Answer with just the number."), self.config.task)


__all__ = ["SumsTaskset"]
