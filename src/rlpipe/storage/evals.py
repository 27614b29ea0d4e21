"""Eval results: one row per (run, version, split); a repeated evaluation replaces the numbers."""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from rlpipe.schemas.tables import EvalResult


def record_eval(s: Session, *, run_id: str, version: int, split: str, n_prompts: int, n_correct: int,
                mean_reward: float, details: dict[str, Any]) -> None:
    values = dict(run_id=run_id, version=version, split=split, n_prompts=n_prompts, n_correct=n_correct,
                  accuracy=n_correct / n_prompts, mean_reward=mean_reward, details=details)
    statement = insert(EvalResult).values(**values)
    s.execute(statement.on_conflict_do_update(
        constraint="uq_eval_results_run_id_version_split",
        set_={k: statement.excluded[k] for k in ("n_prompts", "n_correct", "accuracy", "mean_reward", "details")}))
