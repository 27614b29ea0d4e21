"""Single-turn integer arithmetic: "What is 48 - 7 * 3?" answered as <answer>27</answer>.

The smallest task on which a 135M model can learn both a format and a skill; difficulty knobs
(operands, digits, operators) make it as hard as a run needs.
"""

import random
from collections.abc import Sequence

from rlpipe.envs.base import Environment, Problem, Rubric
from rlpipe.schemas.task import ArithmeticDifficulty, EnvConfig


def draw_operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    """A number with a uniformly drawn digit count; one digit includes 0."""
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def evaluate_chain(operands: Sequence[int], operators: Sequence[str]) -> int:
    """Value of `o0 op0 o1 op1 ...` with * binding tighter than + and -, left to right otherwise."""
    assert len(operators) == len(operands) - 1
    terms, signs = [operands[0]], [1]
    for op, x in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= x  # a product stays inside the current term
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms))


def format_chain(operands: Sequence[int], operators: Sequence[str]) -> str:
    parts = [str(operands[0])]
    for op, x in zip(operators, operands[1:]):
        parts += [op, str(x)]
    return " ".join(parts)


class ArithmeticEnv(Environment):
    """Answer an integer expression in one message, no tools."""

    name = "arithmetic"
    system_prompt = (
        "Solve the arithmetic problem. Multiplication comes before addition and subtraction. "
        "Write the final integer inside answer tags, for example: <answer>42</answer>"
    )
    rubric = Rubric({"answer_match": 1.0})
    default_difficulty = ArithmeticDifficulty()

    def __init__(self, config: EnvConfig) -> None:
        super().__init__(config)
        self.difficulty = config.difficulty or self.default_difficulty

    def sample_problem(self, rng: random.Random) -> Problem:
        d = self.difficulty
        operands = [draw_operand(rng, d.min_digits, d.max_digits) for _ in range(d.num_operands)]
        operators = [rng.choice(d.operators) for _ in range(d.num_operands - 1)]
        expression = format_chain(operands, operators)
        return Problem(
            question=f"What is {expression}?",
            reference=str(evaluate_chain(operands, operators)),
            metadata={"expression": expression},
        )


class PlainArithmeticEnv(ArithmeticEnv):
    """The same questions, answered in plain words: the last integer of the reply counts
    (graders/rules.py FinalNumberGrader). The task of the demo: SmolLM2-135M-Instruct never
    writes answer tags but does answer with numbers, correctly ~12 % of the time at T=1
    (docs/task-calibration.md), so GRPO has groups to learn from."""

    name = "arithmetic_plain"
    system_prompt = "Answer with just the number."
    rubric = Rubric({"final_number": 1.0})
