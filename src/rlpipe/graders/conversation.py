"""The whole episode as a grader that reads it sees it: the model's messages and the tool results between.

Most graders judge the final model message only. A grader whose rubric looks at the episode (did the model
call a tool, what did the tool say: a `verifiers` rubric reads its trace) sets `reads_conversation`, and
its `response_text` is then this JSON instead, built the same way from stored turns (the grader box) and
from a greedy episode (held-out evaluation). Being text, it is also what the grade cache is keyed on, so a
cached grade is reused only for the same episode.

    [{"role": "assistant", "content": "<calculator_add>{\"a\": 2, \"b\": 3}</calculator_add>",
      "tool_calls": [{"name": "calculator_add", "arguments": "{\"a\": 2, \"b\": 3}"}]},
     {"role": "tool", "name": "calculator_add", "content": "5", "ok": true, "error": null},
     {"role": "assistant", "content": "5"}]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]


def assistant_message(text: str, calls: Sequence[tuple[str, str]]) -> Message:
    """A model message; `calls` are the (name, arguments) of the tool calls it made that ran."""
    message: Message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"name": name, "arguments": arguments} for name, arguments in calls]
    return message


def tool_message(name: str, ok: bool, output: str, error: str | None) -> Message:
    """A tool's result as the model was shown it (its output, and why it failed when it did)."""
    return {"role": "tool", "name": name, "content": output, "ok": ok, "error": error}


def stored_turn_messages(output_text: str, tool_calls: Sequence[dict[str, Any]] | None) -> list[Message]:
    """The messages of one stored turn (`turns.output_text` and `turns.tool_calls` with their results)."""
    calls = [call for call in tool_calls or () if call.get("result") is not None]
    messages = [assistant_message(output_text, [(call["name"], call["arguments"]) for call in calls])]
    for call in calls:
        result = call["result"]
        messages.append(tool_message(call["name"], result["ok"], result["output"], result.get("reason")))
    return messages


def conversation_text(messages: Sequence[Message]) -> str:
    """The episode as the text a conversation-reading grader scores (and its grades are cached under)."""
    return json.dumps(list(messages), ensure_ascii=False, sort_keys=True)


def parse_conversation(text: str) -> list[Message]:
    """The messages of `conversation_text`, or ValueError when `text` is not one (a grader that reads the
    conversation was handed a plain reply)."""
    try:
        messages = json.loads(text)
    except json.JSONDecodeError:
        messages = None
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in ("assistant", "tool") for m in messages):
        raise ValueError(f"not an episode's conversation (rlpipe.graders.conversation): {text[:80]!r}")
    return messages
