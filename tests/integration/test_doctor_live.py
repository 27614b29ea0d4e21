"""The doctor on real runs: each pathology is created deliberately on the real stack (workers,
Temporal, Postgres, S3, vLLM) by a config change that a user could make, and the doctor must name
it; a healthy run must pass (no check is a problem).

    slow grader      an LLM judge 0.5 s away (a delaying proxy in front of the
                     real vLLM server), one judgement at a time      -> grader_share
    sandbox tail     lognormal tool latency, sigma 2 (p99 ~100x p50)  -> sandbox_tail
    long sync        sync.interval 4, max_staleness 4                -> staleness (sync_interval)
    slow trainer     two data-parallel ranks x 4 micro-batches, while
                     16 groups may run 6 steps ahead                  -> buffer_depth (trainer_bound)

tests/integration/test_report_doctor.py covers every check's thresholds on synthetic runs; this
module proves the measurements behind them come out of the live pipeline as the doctor expects.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from temporalio.client import Client

from rlpipe.infra.process import free_port
from rlpipe.infra.settings import LOOPBACK
from rlpipe.observe import doctor
from rlpipe.storage.db import Database
from tests.integration.runs import run_to_end, tiny_config, tiny_judge

pytestmark = [pytest.mark.stack, pytest.mark.vllm, pytest.mark.usefixtures("clean_workflows")]

JUDGE_DELAY_S = 0.5  # a hosted judge's usual round trip


@pytest.fixture(scope="module")
def slow_judge(inference_servers: list[str]) -> Iterator[str]:
    """An OpenAI-compatible endpoint that answers like the real vLLM server, JUDGE_DELAY_S later."""
    app = FastAPI()
    upstream = inference_servers[0]

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        await asyncio.sleep(JUDGE_DELAY_S)
        async with httpx.AsyncClient(base_url=upstream, timeout=60) as http:
            return (await http.post("/v1/chat/completions", json=await request.json())).json()

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
    yield f"http://{LOOPBACK}:{port}"
    server.should_exit = True
    thread.join(10)


async def diagnosed(temporal_client: Client, db: Database, tiny_model: Path, config_file: str = "tiny-arithmetic.toml",
                    **overrides: Any) -> dict[str, doctor.Finding]:
    """Run a tiny config with `overrides` to the end; the doctor's findings by check name."""
    cfg = tiny_config(tiny_model, config_file, **overrides)
    await run_to_end(temporal_client, cfg)
    with db.begin() as s:
        findings = doctor.diagnose(s, cfg.name)
    doctor.print_findings(findings, cfg.name)  # shown with -s, and in the failure report
    return {f.check: f for f in findings}


async def test_a_healthy_run_passes(temporal_client: Client, pipeline_workers, migrated_db: Database,
                                    tiny_model: Path) -> None:
    findings = await diagnosed(temporal_client, migrated_db, tiny_model, steps=4)
    assert doctor.doctor_exit_code(list(findings.values())) == 0, {
        name: f.verdict for name, f in findings.items() if f.status == "problem"}


async def test_a_slow_grader_is_named(temporal_client: Client, pipeline_workers, migrated_db: Database,
                                      tiny_model: Path, slow_judge: str) -> None:
    judge = tiny_judge(slow_judge)
    # few eval prompts: each is judged too, JUDGE_DELAY_S apiece, one at a time
    findings = await diagnosed(temporal_client, migrated_db, tiny_model, steps=3, eval={"prompts": 4},
                               grader={"name": "judge", "concurrency": 1, "judge": judge})
    grader = findings[doctor.GRADER_SHARE]
    assert grader.status == "problem", grader
    assert grader.evidence["grade_p50_s"] >= JUDGE_DELAY_S


async def test_a_sandbox_latency_tail_is_named(temporal_client: Client, pipeline_workers, migrated_db: Database,
                                               tiny_model: Path) -> None:
    tail = {"kind": "lognormal", "median_seconds": 0.3, "sigma": 2.0, "max_seconds": 20.0}
    findings = await diagnosed(temporal_client, migrated_db, tiny_model, "tiny-calculator.toml", steps=5,
                               rollout={"tool_latency": tail})
    sandbox = findings[doctor.SANDBOX_TAIL]
    assert sandbox.status == "problem", sandbox
    assert sandbox.evidence["p99_over_p50"] >= doctor.TOOL_TAIL_RATIO


async def test_a_long_sync_interval_is_named_as_the_cause_of_stale_data(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path) -> None:
    findings = await diagnosed(temporal_client, migrated_db, tiny_model, steps=8, max_staleness=4,
                               sync={"interval": 4})
    staleness = findings[doctor.STALENESS]
    assert (staleness.status, staleness.symptom) == ("problem", "sync_interval"), staleness
    assert findings[doctor.SYNC_SHARE].status != "problem"  # rare syncs: the cost is staleness, not time


async def test_a_trainer_slower_than_the_rollouts_is_named(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path) -> None:
    findings = await diagnosed(temporal_client, migrated_db, tiny_model, steps=8, max_staleness=6,
                               rollout={"max_concurrent_groups": 16}, batch={"world_size": 2, "micro_batches": 4})
    buffer = findings[doctor.BUFFER_DEPTH]
    assert (buffer.status, buffer.symptom) == ("problem", "trainer_bound"), buffer
    assert buffer.evidence["wait_steps_late"] > buffer.evidence["wait_steps_early"]  # the buffer grows
