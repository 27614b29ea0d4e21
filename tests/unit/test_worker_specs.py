"""What `rlpipe workers up` starts: the trainer worker alone runs with glibc keeping freed memory."""

from __future__ import annotations

import pytest

from rlpipe.workers.launcher import TRAINER_MALLOC, worker_specs


def test_only_the_trainer_keeps_the_memory_its_steps_free(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in TRAINER_MALLOC:
        monkeypatch.delenv(key, raising=False)
    specs = {spec.name: spec for spec in worker_specs(["0"])}
    assert specs["trainer"].env == TRAINER_MALLOC
    assert {name for name, spec in specs.items() if spec.env} == {"trainer"}


def test_a_malloc_setting_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    trainer = next(spec for spec in worker_specs([]) if spec.name == "trainer")
    assert trainer.env["MALLOC_TRIM_THRESHOLD_"] == "131072"
