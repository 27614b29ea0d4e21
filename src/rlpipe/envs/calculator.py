"""Multi-turn arithmetic with a calculator tool: <calc>347*29</calc> -> "10063" -> <answer>...</answer>.

The questions are the arithmetic environment's, made harder by default (three 2-3 digit operands
with products), so that calling the tool pays. The calculator is a restricted expression evaluator that runs in
process: it walks the parsed expression and allows only numbers, + - * / // % **, unary signs and
parentheses, so there is no name lookup, attribute access, call or import to abuse, and every
intermediate result is bounded in size (a power is refused before it is computed). It needs no
sandbox round trip, which keeps a tool turn as cheap as the generation around it.
"""

import ast
import math
import operator
from collections.abc import Callable

from rlpipe.envs.arithmetic import ArithmeticEnv
from rlpipe.envs.base import Executor, ToolResult
from rlpipe.envs.toolcalls import ToolCall
from rlpipe.schemas.task import ArithmeticDifficulty

MAX_EXPRESSION_CHARS = 200
MAX_RESULT_BITS = 4096  # about 1233 decimal digits: far beyond any question, cheap to compute
# Spellings models and people use for operators; "^" means power on a calculator, not xor.
OPERATOR_SPELLINGS = {"×": "*", "÷": "/", "^": "**"}

Number = int | float


class CalcError(ValueError):
    """The expression is not one the calculator evaluates; the message is shown to the model."""


def _checked(value: object) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
        raise CalcError(f"result too large (over {MAX_RESULT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result is not a finite number")
    if not isinstance(value, (int, float)):  # e.g. complex from (-8) ** 0.5
        raise CalcError("result is not a real number")
    return value


def _power(base: Number, exponent: Number) -> Number:
    # |base| >= 2 ** (bit_length - 1), so this lower bound on the result's size is exact enough to
    # refuse 9 ** 9 ** 9 before spending any time on it
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * (abs(base).bit_length() - 1) > MAX_RESULT_BITS:
            raise CalcError(f"result too large (over {MAX_RESULT_BITS} bits)")
    return base**exponent


_BINARY: dict[type[ast.operator], Callable[[Number, Number], object]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], object]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.expr) -> Number:
    match node:
        case ast.Constant(value=value) if type(value) in (int, float):  # not bool, complex or str
            return _checked(value)
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY:
            return _checked(_BINARY[type(op)](_evaluate(left), _evaluate(right)))
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY:
            return _checked(_UNARY[type(op)](_evaluate(operand)))
    raise CalcError(
        f"unsupported syntax ({type(node).__name__}): use numbers, + - * / // % **, and parentheses"
    )


def evaluate_expression(expression: str) -> Number:
    """Value of an arithmetic expression; raises CalcError, with a message for the model, otherwise."""
    text = expression.strip()
    for spelling, python_operator in OPERATOR_SPELLINGS.items():
        text = text.replace(spelling, python_operator)
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as e:  # ValueError: e.g. a NUL byte in the text
        raise CalcError(f"not an arithmetic expression: {text!r}") from e
    try:
        return _evaluate(tree.body)
    except ZeroDivisionError as e:
        raise CalcError("division by zero") from e
    except OverflowError as e:  # int too large for a float, float ** float overflow
        raise CalcError("result too large") from e


def format_number(value: Number) -> str:
    """How the calculator prints a value: whole numbers without '.0', other floats in shortest form."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


class CalculatorEnv(ArithmeticEnv):
    """Harder arithmetic, with a <calc> tool the model may call before it answers."""

    name = "calculator"
    tools = ("calc",)
    default_max_turns = 4
    system_prompt = (
        "Solve the arithmetic problem. You may use a calculator: write <calc>expression</calc>, "
        "for example <calc>123*45</calc>, and you will be told the result. "
        "Write the final integer inside answer tags, for example: <answer>5535</answer>"
    )
    default_difficulty = ArithmeticDifficulty(
        num_operands=3, min_digits=2, max_digits=3, operators=("+", "-", "*")
    )

    async def execute_tool(self, call: ToolCall, executor: Executor) -> ToolResult:
        """Evaluate in process: the evaluator is safe and bounded, so the executor is not needed."""
        try:
            return ToolResult(ok=True, output=format_number(evaluate_expression(call.arguments)))
        except CalcError as e:
            return ToolResult(ok=False, output="", reason=str(e))
