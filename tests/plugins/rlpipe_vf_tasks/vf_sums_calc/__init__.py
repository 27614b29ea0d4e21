"""vf-sums-calc: the sums of vf-sums with a `calc` tool the model may call before it answers.

The tool is a `verifiers` toolset (an MCP server when verifiers runs it; rlpipe calls its method in its
sandbox worker). Its name is bare (TOOL_PREFIX = None) and it takes one argument, so `<calc>3+4</calc>`
calls it in rlpipe's tag protocol. The reward reads the trace: the right answer, and a bonus for having
used the tool."""

import re
from collections.abc import Iterator

import verifiers.v1 as vf
from vf_sums import SumsData, last_integer

SYSTEM_PROMPT = ("Solve the arithmetic problem. You may use a calculator: write <calc>expression</calc>, and you "
                 "will be told the result. Write the final integer inside answer tags, for example: "
                 "<answer>5</answer>")
EXPRESSION = re.compile(r"\s*(-?\d{1,9})\s*([-+*])\s*(-?\d{1,9})\s*")


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the model calls it `calc`, not `calculator_calc`

    @vf.tool
    async def calc(self, expression: str) -> str:
        """Compute `a + b`, `a - b` or `a * b`."""
        match = EXPRESSION.fullmatch(expression)
        if match is None:
            raise ValueError("write two integers with +, - or * between them")
        a, op, b = int(match[1]), match[2], int(match[3])
        return str(a + b if op == "+" else a - b if op == "-" else a * b)


class CalcTask(vf.Task[SumsData]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: SumsData, trace: vf.Trace) -> float:
        return float(last_integer(trace.last_reply) == task.answer)

    @vf.reward(weight=0.25)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self) -> Iterator[CalcTask]:
        for a in range(10):
            for b in range(10):
                yield CalcTask(SumsData(id=f"{a}+{b}", prompt=f"What is {a} + {b}?", answer=a + b,
                                        system_prompt=SYSTEM_PROMPT), self.config.task)


__all__ = ["CalcTaskset"]
