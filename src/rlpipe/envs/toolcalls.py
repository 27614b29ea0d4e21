"""The text protocol between the policy and its tools, both ways.

Model -> tools. A tool call is the tool's name as an XML-like tag, a final answer is an answer tag:

    <calc>347*29</calc>                 call the tool named "calc" with the text "347*29"
    <python>print(f(3))</python>        call the tool named "python"
    <answer>10063</answer>              end the episode with this answer

One tag shape for everything, no attributes, no JSON, no escaping: a 135M model learns to emit it
within a few hundred steps, and the closing tags double as generation stop strings.

Reading rules (`parse_action`), applied to one model message:
1. The earliest opening tag decides. An answer that comes first is Final; anything after it is ignored.
2. A tool call that comes first makes the turn a tool turn: every well-formed call up to the next
   answer tag (or the end) is collected; an answer written after a call is ignored, because the model
   has not seen the tool's result yet.
3. Text with neither tag is Final with no answer and a format error (the grader scores it 0).
4. A malformed call (unterminated, empty) is still returned as a ToolCall carrying an `error`; it is
   never executed and its observation tells the model what was wrong. Calls past the per-turn limit
   become one such error call. Parsing never raises, so a malformed message cannot kill a rollout.

Tools -> model. `to_clean_text` and `truncate_middle` turn raw tool output (str or bytes, any size)
into the text of a tool message: valid UTF-8, no control characters (Postgres text rejects NUL), at
most a fixed number of characters, keeping head and tail because a traceback's last line matters.
"""

import re
from dataclasses import dataclass

ANSWER_TAG = "answer"
INTEGER_ANSWER = re.compile(r"[+-]?[0-9]{1,200}")
"""Plain ASCII integers only; the length cap keeps int() far from Python's digit limit."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from model text; `error` set means it is malformed and will not run."""

    name: str
    arguments: str
    error: str | None = None


@dataclass(frozen=True)
class ToolCalls:
    """The model asked for tools this turn; the rollout runs them and feeds the observations back."""

    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class Final:
    """The episode ends. `answer` is the text inside <answer></answer>, or None with a `format_error`."""

    answer: str | None
    format_error: str | None = None


Action = ToolCalls | Final


def open_tag(name: str) -> str:
    return f"<{name}>"


def close_tag(name: str) -> str:
    return f"</{name}>"


def extract_answer(text: str) -> Final:
    """The first <answer>...</answer> block of `text` (stripped), or a Final saying why there is none."""
    start = text.find(open_tag(ANSWER_TAG))
    if start < 0:
        return Final(None, f"no {open_tag(ANSWER_TAG)}...{close_tag(ANSWER_TAG)} in the response")
    body_start = start + len(open_tag(ANSWER_TAG))
    end = text.find(close_tag(ANSWER_TAG), body_start)
    if end < 0:
        return Final(None, f"unterminated {open_tag(ANSWER_TAG)}: no {close_tag(ANSWER_TAG)} after it")
    return Final(text[body_start:end].strip())


def parse_action(text: str, tool_names: tuple[str, ...], max_calls: int) -> Action:
    """What one model message asks for (rules in the module docstring); never raises."""
    opening = re.compile("|".join(re.escape(open_tag(n)) for n in (ANSWER_TAG, *tool_names)))
    first = opening.search(text)
    if first is None or first.group() == open_tag(ANSWER_TAG):
        return extract_answer(text)

    calls: list[ToolCall] = []
    pos = first.start()
    while (match := opening.search(text, pos)) is not None and match.group() != open_tag(ANSWER_TAG):
        name = match.group()[1:-1]
        body_start = match.end()
        end = text.find(close_tag(name), body_start)
        if end < 0:
            error = f"unterminated {open_tag(name)}: close it with {close_tag(name)}"
            calls.append(ToolCall(name, text[body_start:], error))
            break
        arguments = text[body_start:end].strip()
        if len(calls) == max_calls:  # one error stands for all the excess, so it costs one observation
            error = f"skipped: at most {max_calls} tool calls per turn; this call and any later ones did not run"
            calls.append(ToolCall(name, arguments, error))
            break
        if not arguments:
            error = f"empty {open_tag(name)}{close_tag(name)}: put the input between the tags"
            calls.append(ToolCall(name, arguments, error))
        else:
            calls.append(ToolCall(name, arguments))
        pos = end + len(close_tag(name))
    return ToolCalls(tuple(calls))


# C0 controls except tab and newline, DEL, and C1 controls; lone surrogates are handled by encoding.
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def to_clean_text(output: str | bytes) -> str:
    """Tool output as valid UTF-8 text: undecodable bytes and control characters become U+FFFD."""
    if isinstance(output, bytes):
        text = output.decode("utf-8", errors="replace")
    else:
        text = output.encode("utf-8", errors="replace").decode("utf-8")  # lone surrogates -> '?'
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROL_CHARS.sub("\ufffd", text)


def _cut_marker(cut: int) -> str:
    return f"\n...[{cut} characters cut]...\n"


def truncate_middle(text: str, max_chars: int) -> str:
    """`text` if short enough, else its head and tail around a marker, `max_chars` long in all."""
    if len(text) <= max_chars:
        return text
    overflow = len(text) - max_chars
    # the marker takes room too, so more is cut than the overflow; refit until its count is exact
    marker = _cut_marker(overflow)
    while len(marker) != len(refit := _cut_marker(overflow + len(marker))):
        marker = refit
    marker = refit
    keep = max_chars - len(marker)
    if keep < 2:  # no room for head, marker and tail
        return text[:max_chars]
    tail = keep // 2
    return text[: keep - tail] + marker + text[-tail:]
