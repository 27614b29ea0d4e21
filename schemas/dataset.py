"""`DatasetConfig`: where a dataset environment reads its prompts and references, and how it splits them.

Shapes only, no I/O: the files are read and checked by the environment (`envs.dataset`), once in the
command line before a run starts and again in every worker that builds the environment, since the
workflow that decodes this config must not read files.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DatasetFormat = Literal["auto", "jsonl", "parquet", "hf_disk"]


class DatasetConfig(BaseModel):
    """A user's data as prompts with reference answers: files, columns, system prompt, train/eval split."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    path: str = Field(min_length=1)
    """The train rows (all rows, when the eval rows are carved off it): a JSON Lines file (one object per
    line), a Parquet file (needs pyarrow) or a directory written by `datasets`' save_to_disk (needs
    datasets). A relative path resolves against each worker's working directory, like model.path; every
    worker that builds the environment (rollout, sandbox, grader, trainer) reads it."""
    eval_path: str | None = None
    """The eval rows, in a file of the same kinds; None carves them off `path` (see eval_rows). No eval
    prompt may also be a train prompt."""
    format: DatasetFormat = "auto"
    """How to read both paths; auto goes by the name: .jsonl or .ndjson, .parquet, or a directory (hf_disk)."""
    split: str | None = None
    """For a saved DatasetDict: the split of `path` to read (e.g. 'train'); None for a single Dataset."""
    eval_split: str | None = None
    """For a saved DatasetDict: the split of `eval_path` to read (e.g. 'test')."""
    prompt_column: str = Field("prompt", min_length=1)
    """The column of the user's question (text), sent as the user message."""
    messages_column: str | None = Field(None, min_length=1)
    """A column of chat messages instead ([{role, content}, ...] with roles system, user or assistant,
    ending with a user message): a conversation the model continues. None uses prompt_column."""
    reference_column: str = Field("answer", min_length=1)
    """The column of the reference answer the graders compare with (text, or a number written as text)."""
    id_column: str | None = Field(None, min_length=1)
    """A column of unique row ids (text or integers), kept in the task's metadata as 'id'; None: rows are
    told apart by their prompt."""
    metadata_columns: tuple[str, ...] = ()
    """Columns copied into each task's metadata, where graders (a reward function of yours) read them."""
    system_prompt: str = ""
    """The system message put before every prompt; empty sends none."""
    eval_rows: int | None = Field(None, ge=1)
    """Eval prompts. With eval_path, its first eval_rows rows (None: all). Without, rows carved off `path`
    by a hash of each row's id (or prompt) and env.seed, so the same rows in every process and no row in
    both splits (None: a tenth of the rows, at least one)."""
    shuffle: bool = True
    """Hand out train prompts in an order drawn from env.seed (files are often sorted by topic or
    difficulty); False keeps the file's order."""

    @model_validator(mode="after")
    def _columns_distinct(self) -> DatasetConfig:
        # compared with the default, not `model_fields_set`: a config that went through JSON has every field set
        default_prompt = DatasetConfig.model_fields["prompt_column"].default
        if self.messages_column is not None and self.prompt_column != default_prompt:
            raise ValueError("env.dataset sets both prompt_column and messages_column: the prompt comes from one "
                             "of them; remove the other")
        prompt = self.messages_column or self.prompt_column
        if prompt == self.reference_column:
            raise ValueError(f"env.dataset reads the prompt and the reference from the same column {prompt!r}: "
                             "set reference_column to the answer's column")
        if self.eval_split is not None and self.eval_path is None:
            raise ValueError("env.dataset.eval_split names a split of eval_path, which is not set: set eval_path "
                             "(it may be the same directory as path)")
        return self
