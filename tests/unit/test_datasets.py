"""The dataset environment: a user's rows become train and eval tasks, split without overlap, and every
kind of bad data is refused before a run starts, naming the file, the line and the field."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import rlpipe.graders.registry  # noqa: F401 - the rubric's graders are checked against it
from rlpipe.cli import main as cli
from rlpipe.envs.dataset import DatasetEnv
from rlpipe.envs.records import DatasetError
from rlpipe.envs.registry import build_environment
from rlpipe.schemas.config import ConfigError, parse_run_config
from rlpipe.schemas.task import EnvConfig

QUESTIONS = [{"id": f"q{i}", "prompt": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1), "level": i % 3}
             for i in range(20)]


def write_jsonl(path: Path, rows: list[Any], blank_after: int | None = None) -> Path:
    lines = [json.dumps(row) if not isinstance(row, str) else row for row in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def dataset_env(**dataset: Any) -> DatasetEnv:
    env = build_environment(EnvConfig(name="dataset", dataset=dataset))
    assert isinstance(env, DatasetEnv)
    return env


def all_tasks(env: DatasetEnv, split: str) -> list[Any]:
    return [env.task(split, i) for i in range(env.size(split))]  # type: ignore[arg-type]


# --- good data ----------------------------------------------------------------------------------


def test_carved_eval_rows_are_fixed_by_the_seed_and_never_trained_on(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", QUESTIONS)
    env = dataset_env(path=str(data), id_column="id", eval_rows=5, metadata_columns=["level"])
    train, evals = all_tasks(env, "train"), all_tasks(env, "eval")
    assert (len(train), len(evals)) == (15, 5)
    assert not {t.question for t in train} & {t.question for t in evals}
    assert sorted(t.metadata["id"] for t in train + evals) == sorted(q["id"] for q in QUESTIONS)
    by_id = {q["id"]: q for q in QUESTIONS}
    for task in train + evals:  # each task is its row: prompt, reference and metadata together
        row = by_id[task.metadata["id"]]
        assert (task.question, task.reference, task.metadata["level"]) == (row["prompt"], row["answer"], row["level"])
    # another process with the same config builds the same tasks; another seed carves other rows
    assert all_tasks(dataset_env(path=str(data), id_column="id", eval_rows=5, metadata_columns=["level"]),
                     "eval") == evals
    other = build_environment(EnvConfig(name="dataset", seed=1, dataset={"path": str(data), "eval_rows": 5}))
    assert {t.question for t in all_tasks(other, "eval")} != {t.question for t in evals}  # type: ignore[arg-type]


def test_defaults_carve_a_tenth_and_shuffle_only_when_asked(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", QUESTIONS)
    shuffled = dataset_env(path=str(data))
    assert (shuffled.size("train"), shuffled.size("eval")) == (18, 2)
    in_order = dataset_env(path=str(data), shuffle=False)
    questions = [q["prompt"] for q in QUESTIONS]
    kept = [t.question for t in all_tasks(in_order, "train")]
    assert kept == [q for q in questions if q in kept]  # the file's order
    assert [t.question for t in all_tasks(shuffled, "train")] != kept and \
        sorted(t.question for t in all_tasks(shuffled, "train")) == sorted(kept)


def test_an_eval_file_gives_the_eval_split_in_its_order(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", QUESTIONS[:15])
    evals = write_jsonl(tmp_path / "eval.jsonl", QUESTIONS[15:])
    env = dataset_env(path=str(train), eval_path=str(evals), eval_rows=3)
    assert [t.question for t in all_tasks(env, "eval")] == [q["prompt"] for q in QUESTIONS[15:18]]
    assert env.size("train") == 15
    assert dataset_env(path=str(train), eval_path=str(evals)).size("eval") == 5


def test_parquet_and_saved_datasets_give_the_tasks_the_jsonl_gives(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    settings = {"id_column": "id", "eval_rows": 5, "metadata_columns": ["level"]}
    want = dataset_env(path=str(write_jsonl(tmp_path / "data.jsonl", QUESTIONS)), **settings)
    pq.write_table(pa.Table.from_pylist(QUESTIONS), tmp_path / "data.parquet")
    datasets.Dataset.from_list(QUESTIONS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(QUESTIONS[:15]),
                          "test": datasets.Dataset.from_list(QUESTIONS[15:])}).save_to_disk(str(tmp_path / "dict"))
    for got in (dataset_env(path=str(tmp_path / "data.parquet"), **settings),
                dataset_env(path=str(tmp_path / "saved"), **settings)):
        assert all_tasks(got, "train") == all_tasks(want, "train")
        assert all_tasks(got, "eval") == all_tasks(want, "eval")
    split = dataset_env(path=str(tmp_path / "dict"), split="train", eval_path=str(tmp_path / "dict"), eval_split="test")
    assert (split.size("train"), [t.question for t in all_tasks(split, "eval")]) == \
        (15, [q["prompt"] for q in QUESTIONS[15:]])
    # a bad row is named by its row number in the file it came from
    pq.write_table(pa.Table.from_pylist([*QUESTIONS[:3], {**QUESTIONS[3], "prompt": " "}]), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad\.parquet row 4"):
        dataset_env(path=str(tmp_path / "bad.parquet"))
    with pytest.raises(DatasetError, match=r"dict: is a DatasetDict with splits train, test: set env\.dataset\.split"):
        dataset_env(path=str(tmp_path / "dict"))


def test_the_system_prompt_and_a_messages_column_frame_the_conversation(tmp_path: Path) -> None:
    rows = [{"conversation": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                              {"role": "user", "content": f"What is {i} + 1?"}], "answer": i + 1} for i in range(4)]
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    env = dataset_env(path=str(data), messages_column="conversation", system_prompt="Answer with just the number.",
                      eval_rows=1, shuffle=False)
    task = env.task("train", 0)
    assert task.question.startswith("What is")  # the last user message: what a judge is shown
    assert env.initial_messages(task) == [{"role": "system", "content": "Answer with just the number."},
                                          *rows[[r["answer"] for r in rows].index(int(task.reference))]
                                          ["conversation"]]
    assert task.reference == str(int(task.question.split()[2]) + 1)  # a number becomes its text
    plain = dataset_env(path=str(write_jsonl(tmp_path / "plain.jsonl", QUESTIONS)))
    first = plain.task("train", 0)
    assert plain.initial_messages(first) == [{"role": "user", "content": first.question}]  # no system prompt


def test_a_whole_float_reference_reads_as_the_integer(tmp_path: Path) -> None:
    # Parquet and pandas store an integer column with gaps as floats
    data = write_jsonl(tmp_path / "floats.jsonl", [{"prompt": f"p{i}", "answer": float(i)} for i in range(3)] +
                       [{"prompt": "p3", "answer": 2.5}])
    env = dataset_env(path=str(data), eval_rows=1)
    assert sorted(t.reference for t in all_tasks(env, "train") + all_tasks(env, "eval")) == ["0", "1", "2", "2.5"]


# --- bad data: each names the file, the line and the field ---------------------------------------


@pytest.mark.parametrize(("rows", "settings", "message"), [
    ([{"question": "What is 1 + 1?", "answer": "2"}], {},
     "data.jsonl line 1: field 'prompt' is missing (the row has 'answer', 'question'): fix the row, or set "
     "env.dataset.prompt_column to the column that holds it"),
    (QUESTIONS[:3] + [{"prompt": "What is 9 + 9?"}], {},
     "data.jsonl line 4: field 'answer' is missing (the row has 'prompt')"),
    (QUESTIONS[:2] + [{"prompt": "   ", "answer": "1"}], {}, "data.jsonl line 3: field 'prompt' (the prompt) is empty"),
    (QUESTIONS[:2] + [{"prompt": "x", "answer": ""}], {},
     "data.jsonl line 3: field 'answer' (the reference answer) is empty"),
    (QUESTIONS[:2] + [{"prompt": ["a"], "answer": "1"}], {},
     "data.jsonl line 3: field 'prompt' (the prompt) must be text or a number, found list [\"a\"]"),
    (QUESTIONS[:4] + [{**QUESTIONS[5], "id": "q1"}], {"id_column": "id"},
     "data.jsonl line 5: duplicate id 'q1', first at data.jsonl line 2 (the same file)"),
    (QUESTIONS[:4] + [{**QUESTIONS[1], "id": "q99"}], {"id_column": "id"},
     "data.jsonl line 5: duplicate prompt 'What is 1 + 2?', first at data.jsonl line 2 (the same file)"),
    (QUESTIONS[:3] + ["{\"prompt\": \"x\", "], {}, "data.jsonl line 4: not valid JSON (Expecting property name "
                                                   "enclosed in double quotes at column 17)"),
    (QUESTIONS[:1] + ["[1, 2]"], {}, "data.jsonl line 2: a row must be a JSON object, found list"),
    (QUESTIONS[:5], {"eval_rows": 5},
     "data.jsonl: 5 eval rows are to be carved off, but the data has only 5 rows and training needs at least one"),
    (QUESTIONS[:1], {}, "data.jsonl: 1 eval rows are to be carved off, but the data has only 1 rows"),
    (QUESTIONS[:3], {"metadata_columns": ["difficulty"]},
     "data.jsonl line 1: field 'difficulty' is missing (the row has 'answer', 'id', 'level', 'prompt'): fix the "
     "row, or set env.dataset.metadata_columns"),
    ([{"chat": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], "answer": "1"}],
     {"messages_column": "chat"}, "data.jsonl line 1: field 'chat' (the prompt) ends with a assistant message: "
                                  "the last message must be the user's"),
    ([{"chat": [{"role": "robot", "content": "Hi"}], "answer": "1"}], {"messages_column": "chat"},
     "data.jsonl line 1: field 'chat' message 0: must be an object with a role (system, user, assistant)"),
    ([{"chat": [{"role": "user", "content": ""}], "answer": "1"}], {"messages_column": "chat"},
     "data.jsonl line 1: field 'chat' message 0 (user): the content is empty or not text"),
    ([], {}, "data.jsonl: has no rows"),
    (QUESTIONS[:3], {"split": "train"},
     "data.jsonl: a split ('train') is set, but only a saved DatasetDict has splits"),
], ids=["missing-prompt", "missing-reference", "empty-prompt", "empty-reference", "prompt-not-text", "duplicate-id",
        "duplicate-prompt", "bad-json", "not-an-object", "eval-larger-than-data", "one-row", "missing-metadata",
        "messages-end-with-assistant", "unknown-role", "empty-message", "empty-file", "split-of-a-file"])
def test_bad_rows_are_refused_naming_the_file_line_and_field(
        tmp_path: Path, rows: list[Any], settings: dict[str, Any], message: str) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", rows) if rows else tmp_path / "data.jsonl"
    if not rows:
        data.write_text("\n\n")
    with pytest.raises(DatasetError) as caught:
        dataset_env(path=str(data), **settings)
    assert message in str(caught.value).replace(str(tmp_path) + "/", "")


def test_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", QUESTIONS[:3] + [{"prompt": "x"}], blank_after=1)
    with pytest.raises(DatasetError, match=r"data\.jsonl line 5: field 'answer' is missing"):
        dataset_env(path=str(data))


def test_an_eval_file_must_not_repeat_train_rows_nor_be_shorter_than_asked(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", QUESTIONS[:10])
    leaky = write_jsonl(tmp_path / "eval.jsonl", [QUESTIONS[12], {**QUESTIONS[3], "id": "e3"}])
    with pytest.raises(DatasetError, match=r"eval\.jsonl line 2: duplicate prompt 'What is 3 \+ 4\?', first at "
                                           r".*train\.jsonl line 4 \(the train data\)"):
        dataset_env(path=str(train), eval_path=str(leaky), id_column="id")
    same_id = write_jsonl(tmp_path / "eval2.jsonl", [{**QUESTIONS[12], "id": "q2"}])
    with pytest.raises(DatasetError, match=r"eval2\.jsonl line 1: duplicate id 'q2', first at .*train\.jsonl line 3"):
        dataset_env(path=str(train), eval_path=str(same_id), id_column="id")
    short = write_jsonl(tmp_path / "eval3.jsonl", QUESTIONS[12:14])
    with pytest.raises(DatasetError, match=r"eval3\.jsonl: env\.dataset\.eval_rows is 5, but the eval data has only "
                                           r"2 rows: lower eval_rows"):
        dataset_env(path=str(train), eval_path=str(short), eval_rows=5)


def test_files_that_cannot_be_read_say_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DatasetError, match=r"missing\.jsonl: no such file or directory \(.*a relative path resolves"):
        dataset_env(path=str(tmp_path / "missing.jsonl"))
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match=r"data\.csv: cannot tell its format from the name: name it \*\.jsonl or "
                                           r"\*\.parquet, or set env\.dataset\.format"):
        dataset_env(path=str(tmp_path / "data.csv"))
    # neither optional reader is one of rlpipe's dependencies: without it, the error says what to install
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match=r"data\.parquet: reading Parquet needs pyarrow, .*`pip install pyarrow`"):
        dataset_env(path=str(tmp_path / "data.parquet"))
    (tmp_path / "saved").mkdir()
    with pytest.raises(DatasetError, match=r"saved: reading a saved Hugging Face dataset needs `datasets`, .*"
                                           r"`pip install datasets`"):
        dataset_env(path=str(tmp_path / "saved"))


# --- the config: checked before anything is read -------------------------------------------------


@pytest.mark.parametrize(("env", "message"), [
    ({"name": "dataset"}, "env.name 'dataset' needs env.dataset: set at least env.dataset.path"),
    ({"name": "dataset", "eval_size": 10, "dataset": {"path": "d.jsonl"}},
     "env.eval_size does not apply to a dataset, whose rows are the prompts: remove it; env.dataset.eval_rows"),
    ({"name": "dataset", "dataset": {"path": "d.jsonl", "prompt_column": "q", "messages_column": "m"}},
     "env.dataset sets both prompt_column and messages_column"),
    ({"name": "dataset", "dataset": {"path": "d.jsonl", "reference_column": "prompt"}},
     "env.dataset reads the prompt and the reference from the same column 'prompt'"),
    ({"name": "dataset", "dataset": {"path": "d.jsonl", "eval_split": "test"}},
     "env.dataset.eval_split names a split of eval_path, which is not set"),
    ({"name": "dataset", "dataset": {"path": "d.jsonl", "eval_rows": 0}},
     "env.dataset.eval_rows: Input should be greater than or equal to 1"),
    ({"name": "dataset", "dataset": {"path": "d.jsonl", "colums": ["x"]}},
     "env.dataset.colums: unknown field"),
])
def test_dataset_settings_are_checked_with_the_config(env: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_run_config({"env": env})
    assert message in str(caught.value)


def test_a_dataset_given_to_an_environment_that_reads_none_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="env.dataset is set, but environment 'arithmetic' reads no dataset"):
        build_environment(EnvConfig(name="arithmetic", dataset={"path": str(tmp_path / "d.jsonl")}))


def run_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
              env: str) -> tuple[int | str | None, str]:
    """`rlpipe run start` on a config with this [env] table; the Temporal client is never made."""
    def no_client() -> None:
        raise AssertionError("reached Temporal")

    monkeypatch.setattr(cli, "_client", no_client)
    config = tmp_path / "run.toml"
    config.write_text(f'name = "ds"\nsteps = 2\n{env}')
    with pytest.raises((SystemExit, AssertionError)) as exited:
        cli.main(["run", "start", str(config)])
    code = exited.value.code if isinstance(exited.value, SystemExit) else "reached Temporal"
    return code, " ".join(capsys.readouterr().out.split())  # rich wraps long lines


def test_the_cli_refuses_bad_data_before_it_starts_a_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", QUESTIONS[:4] + [{"id": "q9", "answer": "3"}])
    code, out = run_start(tmp_path, monkeypatch, capsys, f'[env]\nname = "dataset"\ndataset = {{path = "{data}"}}\n')
    assert code == 2 and "Traceback" not in out
    assert f"environment 'dataset' cannot produce its tasks: DatasetError: {data} line 5: field 'prompt' is " \
           "missing" in out


def test_the_cli_leaves_data_it_cannot_see_to_the_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    env = '[env]\nname = "dataset"\ndataset = {path = "/nowhere.jsonl"}\n'
    code, out = run_start(tmp_path, monkeypatch, capsys, env)
    assert code == "reached Temporal"
    assert "warning: /nowhere.jsonl: no such file or directory" in out and "the workers check it when the run " \
                                                                         "starts" in out


def test_a_dataset_config_survives_the_json_of_payloads_and_the_runs_table() -> None:
    """Temporal's payloads and the runs table hold the config as JSON with every field written out: the
    checks must not mistake a default written out for a setting."""
    config = parse_run_config({"env": {"name": "dataset", "dataset": {"path": "d.jsonl", "messages_column": "chat"}}})
    assert parse_run_config(config.model_dump(mode="json")) == config
