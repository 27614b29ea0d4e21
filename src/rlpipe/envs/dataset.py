"""The 'dataset' environment: prompts and reference answers from a user's data, graded by any grader.

    {"id": "q1", "prompt": "What is 7 - 2?", "answer": "5"}          one row of train.jsonl
    [env]
    name = "dataset"
    dataset = {path = "train.jsonl", id_column = "id", system_prompt = "Answer with just the number."}
    [grader]
    name = "final_number"   # or "answer_match", or a reward function: "my_pkg.rewards:exact"

Every row is checked when the environment is built (the command line builds it before it starts a
run, the workers again at the run's start): a missing column, an empty prompt or reference, a
duplicate id or prompt, or an eval split larger than the data is a `DatasetError` naming the file, the
line and the field. Eval rows never repeat a train prompt, whether given as a file or carved off the
data (by a hash of each row's id, or its prompt, and env.seed: the same rows in every process).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, get_args

from rlpipe.envs.base import SPLITS, ChatMessage, Environment, Problem, Rubric, Split, Task
from rlpipe.envs.records import DatasetError, Record, read_records
from rlpipe.schemas.dataset import DatasetConfig
from rlpipe.schemas.task import EnvConfig

CONVERSATION_ROLES = ("system", "user", "assistant")
DEFAULT_EVAL_FRACTION = 10  # without eval_rows, one row in ten is carved off for eval


@dataclass(frozen=True)
class Row:
    """One checked row: the conversation the model continues and what graders compare its reply with."""

    where: str  # "train.jsonl line 7"
    key: str  # what tells rows apart: the id, else the prompt
    prompt: str  # the prompt's text (the conversation as JSON for a messages column): no two rows share it
    messages: tuple[ChatMessage, ...]  # without the system prompt
    reference: str
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def question(self) -> str:
        """The last user message: what a judge is shown as the task."""
        return self.messages[-1]["content"]


@dataclass(frozen=True)
class DatasetSplits:
    train: list[Row]
    eval: list[Row]


def _column(record: Record, column: str, setting: str) -> Any:
    if column not in record.values:
        raise DatasetError(f"{record.where}: field {column!r} is missing (the row has "
                           f"{', '.join(map(repr, sorted(record.values))) or 'no fields'}): fix the row, or set "
                           f"env.dataset.{setting} to the column that holds it")
    return record.values[column]


def _text(record: Record, column: str, setting: str, what: str) -> str:
    value = _column(record, column, setting)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DatasetError(f"{record.where}: field {column!r} ({what}) must be text or a number, found "
                           f"{type(value).__name__} {json.dumps(value, default=str)[:80]}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # Parquet and pandas store an integer column with gaps as floats: 5.0 means 5
    text = str(value)
    if not text.strip():
        raise DatasetError(f"{record.where}: field {column!r} ({what}) is empty")
    return text


def _messages(record: Record, column: str) -> tuple[ChatMessage, ...]:
    value = _column(record, column, "messages_column")
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{record.where}: field {column!r} (the prompt) must be a non-empty list of chat "
                           "messages [{\"role\": ..., \"content\": ...}]")
    messages: list[ChatMessage] = []
    for position, message in enumerate(value):
        at = f"{record.where}: field {column!r} message {position}"
        if not isinstance(message, dict) or message.get("role") not in CONVERSATION_ROLES:
            raise DatasetError(f"{at}: must be an object with a role ({', '.join(CONVERSATION_ROLES)}) and a content")
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            raise DatasetError(f"{at} ({message['role']}): the content is empty or not text")
        messages.append({"role": message["role"], "content": content})
    if messages[-1]["role"] != "user":
        raise DatasetError(f"{record.where}: field {column!r} (the prompt) ends with a {messages[-1]['role']} "
                           "message: the last message must be the user's, which the model answers")
    return tuple(messages)


def parse_row(record: Record, cfg: DatasetConfig) -> Row:
    """The row `record` is, or DatasetError naming its line and the field that is wrong."""
    if cfg.messages_column is not None:
        messages = _messages(record, cfg.messages_column)
        prompt = json.dumps(messages, ensure_ascii=False)
    else:
        prompt = _text(record, cfg.prompt_column, "prompt_column", "the prompt")
        messages = ({"role": "user", "content": prompt},)
    reference = _text(record, cfg.reference_column, "reference_column", "the reference answer")
    metadata: dict[str, Any] = {}
    for column in cfg.metadata_columns:
        value = _column(record, column, "metadata_columns")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise DatasetError(f"{record.where}: field {column!r} (metadata) is not plain JSON ({exc})") from None
        metadata[column] = value
    key = prompt
    if cfg.id_column is not None:
        key = _text(record, cfg.id_column, "id_column", "the id")
        metadata["id"] = key
    return Row(record.where, key, prompt, messages, reference, metadata)


def _rows(path: str, cfg: DatasetConfig, split: str | None) -> list[Row]:
    rows = [parse_row(record, cfg) for record in read_records(path, cfg.format, split)]
    _refuse_repeats(rows, rows)
    return rows


def _refuse_repeats(rows: list[Row], against: list[Row]) -> None:
    """DatasetError at the first row of `rows` whose id or prompt an earlier row of `against` has (the
    same list: duplicates within a file; the train rows: an eval row that is also a train row)."""
    by_key: dict[str, Row] = {}
    by_prompt: dict[str, Row] = {}
    for row in against:
        by_key.setdefault(row.key, row)
        by_prompt.setdefault(row.prompt, row)
    for row in rows:
        checks = [(by_prompt, row.prompt, "prompt")]
        if "id" in row.metadata:  # else the key is the prompt
            checks.insert(0, (by_key, row.key, "id"))
        for seen, value, what in checks:
            first = seen.get(value)
            if first is None:
                continue
            if first is not row:  # (`first is row` only within one file: a row meets itself)
                same = "the same file" if rows is against else "the train data"
                raise DatasetError(f"{row.where}: duplicate {what} {value[:80]!r}, first at {first.where} ({same}): "
                                   "every prompt must be one row, so that no eval prompt is also trained on; "
                                   "remove the repeat")


def _order(rows: list[Row], seed: int, salt: str) -> list[Row]:
    """`rows` in an order drawn from (seed, salt, each row's key): the same in every process."""
    return sorted(rows, key=lambda row: hashlib.sha256(f"{seed}/{salt}/{row.key}".encode()).digest())


def load_dataset(cfg: DatasetConfig, seed: int) -> DatasetSplits:
    """The checked train and eval rows of `cfg`'s data (DatasetError naming the file, line and field)."""
    rows = _rows(cfg.path, cfg, cfg.split)
    if cfg.eval_path is not None:
        evals = _rows(cfg.eval_path, cfg, cfg.eval_split)
        if cfg.eval_rows is not None and cfg.eval_rows > len(evals):
            raise DatasetError(f"{cfg.eval_path}: env.dataset.eval_rows is {cfg.eval_rows}, but the eval data has "
                               f"only {len(evals)} rows: lower eval_rows, or leave it unset to use them all")
        evals = evals[:cfg.eval_rows]
        _refuse_repeats(evals, rows)
        train = rows
    else:
        carved = cfg.eval_rows if cfg.eval_rows is not None else max(1, len(rows) // DEFAULT_EVAL_FRACTION)
        if carved >= len(rows):
            raise DatasetError(f"{cfg.path}: {carved} eval rows are to be carved off, but the data has only "
                               f"{len(rows)} rows and training needs at least one: lower env.dataset.eval_rows, "
                               "or give the eval rows in a file of their own (eval_path)")
        ordered = _order(rows, seed, "eval")
        evals, chosen = ordered[:carved], {row.key for row in ordered[:carved]}
        train = [row for row in rows if row.key not in chosen]
    return DatasetSplits(_order(train, seed, "train") if cfg.shuffle else train, evals)


class DatasetEnv(Environment):
    """Single-turn prompts from a user's data; the reply is graded against the row's reference.

    The default rubric reads the reply's last integer (`final_number`); set grader.name for another
    grader (answer_match for <answer> tags, a judge, a reward function of yours by import path), or
    subclass this environment with a rubric of its own.
    """

    name = "dataset"
    system_prompt = ""  # the config's (env.dataset.system_prompt)
    rubric = Rubric({"final_number": 1.0})
    reads_dataset = True

    def __init__(self, config: EnvConfig) -> None:
        super().__init__(config)
        if config.dataset is None:
            raise ValueError(f"environment {self.name!r} reads a dataset: set env.dataset (at least its path)")
        self.dataset = config.dataset
        self.rows = load_dataset(config.dataset, config.seed)

    def _split(self, split: Split) -> list[Row]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: use one of {get_args(Split)}")
        return self.rows.train if split == "train" else self.rows.eval

    def size(self, split: Split) -> int:
        return len(self._split(split))

    def task(self, split: Split, index: int) -> Task:
        rows = self._split(split)
        if not 0 <= index < len(rows):
            raise IndexError(f"{split} index {index} is outside 0..{len(rows) - 1} of env {self.name!r}")
        row = rows[index]
        return Task(id=f"{self.name}:{self.config.seed}:{split}:{index}", split=split, index=index,
                    question=row.question, reference=row.reference, metadata=row.metadata)

    def sample_problem(self, rng: random.Random) -> Problem:
        """A train row drawn with `rng` (the splits themselves are fixed by the data, not drawn)."""
        row = rng.choice(self.rows.train)
        return Problem(question=row.question, reference=row.reference, metadata=row.metadata)

    def initial_messages(self, task: Task) -> list[ChatMessage]:
        conversation = list(self._split(task.split)[task.index].messages)
        system = self.dataset.system_prompt
        return [{"role": "system", "content": system}, *conversation] if system else conversation
