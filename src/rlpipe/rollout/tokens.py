"""Token-level conversation plumbing for ChatML models (SmolLM2 and the tiny test model).

A tool turn ends at the tool's closing tag (a stop string), inside the assistant message. The
observation is appended as ids: close the assistant message, a `tool` message with the output,
and a fresh assistant header for the model to continue from. These ids are env tokens (mask 0).
"""

from __future__ import annotations

import hashlib

from transformers import PreTrainedTokenizerBase

from rlpipe.policy.chat import IM_END


def observation_ids(tokenizer: PreTrainedTokenizerBase, observations: list[str]) -> list[int]:
    """Ids appended after a tool turn: `<|im_end|>\\n`, one tool message per call, then the
    assistant header the model continues from."""
    messages = [{"role": "tool", "content": text} for text in observations]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(f"{IM_END}\n{text}", add_special_tokens=False))


def request_seed(base_seed: int, run_id: str, group_index: int, sample_index: int, turn_index: int) -> int:
    """A per-request sampling seed: the same request retried samples the same tokens (on the same
    weights), and different samples of a group differ."""
    key = f"{base_seed}/{run_id}/{group_index}/{sample_index}/{turn_index}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") & 0x7FFFFFFF
