"""Chat format helpers: the ChatML template and prompt token ids for a list of messages.

Rollouts are token-in, token-out: a prompt is rendered to ids once, with the model's own
chat template, and every later turn appends ids (never re-tokenised text).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rlpipe.envs.base import ChatMessage

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# The same ChatML shape SmolLM2-Instruct uses, minus its default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a model directory (local files only, never the Hub)."""
    return AutoTokenizer.from_pretrained(Path(model_dir), local_files_only=True)


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template, ending with the
    assistant header when `add_generation_prompt` (what a sampler continues from)."""
    conversation = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))
