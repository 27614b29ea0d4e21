"""Weight sync end to end against the physical floor (issue #8, item 3).

Transfer: for the tiny model and SmolLM2-135M (fp32 safetensors, as the trainer publishes them), the
project's checkpoint transfer (weights/checkpoints.py: content-addressed upload with sha256, then a
download hashed while it streams, on a private SeaweedFS) against plain copies of the same files on
this disk, the floor: hot (source in the page cache) and cold (source evicted from this VM's page
cache first). Nothing is fsynced, so every destination lands in the page cache, as S3's does; each
timed step starts with no dirty pages (os.sync), so no step pays for the writeback of the one before.
A whole sync is held against the fastest of these copies.

Server side: one vLLM server on SmolLM2. Each sync publishes a version the way the trainer does (S3
upload, then the `policy_versions` row with the trainer's probe) and the project's sidecar
(weights.sidecar.Sidecar.sync) loads it: download, pause, reload, verify against the probe, resume.
Versions alternate between two perturbed copies of SmolLM2, so every reload changes the weights,
and each sync has a run of its own, so every upload is real (content addressing dedupes identical
files within a run). Paths: S3 in the default pause mode ('wait') and in 'keep', and the co-located
sidecar that reads the trainer's directory in place (RLPIPE_SHARED_CHECKPOINTS; it still checks the
sha256), and the hot path (sync.transport "stream": the server's vLLM weight-transfer engine pulls
the version from the trainer's weight stream, weights/stream.py; the S3 upload still happens, but
beside the sync, so it is not part of that path's end to end). The server is idle during syncs, so the pause window is the swap itself; 'wait' would add
the longest generation in flight. One unrecorded warm-up sync comes first.

The tiny model's server-side phases and the sync share of wall time at sync intervals 1, 2 and 4
come from the async-vs-sync runs (benchmarks/async_vs_sync.py records them; report.py shows them
beside these).

    .venv/bin/python -m benchmarks.weight_sync [--repeats 3 --sync-repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import private_stack, progress_bar, smollm2_model, summarize, timed, tiny_model, write_result

NAME = "weight_sync"
PERTURBATION = 0.05
"""Noise added to every weight matrix, in units of its own standard deviation (as the sync tests do)."""
PATHS: dict[str, tuple[str, str]] = {"S3, pause 'wait' (default)": ("s3", "wait"), "S3, pause 'keep'": ("s3", "keep"),
                                     "shared filesystem, pause 'wait'": ("shared", "wait"),
                                     "trainer's stream, pause 'wait'": ("stream", "wait")}
"""Sync path label -> (where the sidecar reads the checkpoint, pause mode)."""
PHASES = ("upload_s", "download_s", "pause_s", "reload_s", "verify_s", "total_s", "end_to_end_s")


# -- transfer against the floor -------------------------------------------------------------------
def copy_dir(src: Path, dest: Path) -> None:
    """The floor: the same files copied on the local disk."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file():
            shutil.copyfile(path, dest / path.name)


def evict(directory: Path) -> None:
    """Drop the directory's files from the page cache (only theirs: other engineers' caches stay).
    Dirty pages cannot be dropped, so the files are flushed first."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def flushed_timed(fn: Callable[[], Any]) -> float:
    """Seconds of `fn`, started with no dirty pages on the machine: the writeback of the step before
    (0.5 GB of SmolLM2 written by the last copy or download) would otherwise throttle this one."""
    os.sync()
    return timed(fn)


def transfer_once(store, source: Path, scratch: Path) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Seconds of: a copy from a cold source, an upload (fresh run id, so nothing is deduplicated),
    a verified download, and a copy from a hot source. The cold copy comes first and warms the
    source, so the upload, like the hot copy, reads it from the page cache."""
    from rlpipe.weights.checkpoints import download_checkpoint, upload_checkpoint

    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    evict(source)
    cold = flushed_timed(lambda: copy_dir(source, scratch / f"{run_id}-cold"))
    manifest: list[Any] = []
    up = flushed_timed(lambda: manifest.append(upload_checkpoint(store, run_id, 1, 1, source)))
    down = flushed_timed(lambda: download_checkpoint(store, manifest[0], scratch / run_id))
    hot = flushed_timed(lambda: copy_dir(source, scratch / f"{run_id}-hot"))
    for path in scratch.iterdir():
        shutil.rmtree(path)
    return {"upload_s": up, "download_s": down, "raw_copy_s": hot, "raw_copy_cold_s": cold,
            "bytes": manifest[0].total_bytes}


def transfer_table(raw: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per model: each quantity's summary, and the transfer against both floors."""
    table = {}
    for name, reps in raw.items():
        e2e = [r["upload_s"] + r["download_s"] for r in reps]
        table[name] = {"bytes": reps[0]["bytes"],
                       **{k: summarize([r[k] for r in reps]) for k in ("upload_s", "download_s", "raw_copy_s",
                                                                       "raw_copy_cold_s")},
                       "upload_plus_download_s": summarize(e2e),
                       "ratio_to_raw_copy": summarize([t / r["raw_copy_s"] for t, r in zip(e2e, reps)]),
                       "ratio_to_cold_copy": summarize([t / r["raw_copy_cold_s"] for t, r in zip(e2e, reps)]),
                       "raw_copy_mb_per_s": summarize([r["bytes"] / r["raw_copy_s"] / 1e6 for r in reps]),
                       "raw_copy_cold_mb_per_s": summarize([r["bytes"] / r["raw_copy_cold_s"] / 1e6 for r in reps]),
                       "transfer_mb_per_s": summarize([r["bytes"] / t / 1e6 for t, r in zip(e2e, reps)])}
    return table


def measure_transfers(store, models: dict[str, Path], repeats: int) -> dict[str, list[dict[str, float]]]:  # type: ignore[no-untyped-def]
    """Repeats alternate between the models; sources are private copies, so that no other process
    (a server that maps the model) keeps them in the page cache when they are evicted."""
    scratch = Path(tempfile.mkdtemp(prefix="rlpipe-bench-sync-"))
    try:
        sources = {name: scratch / "src" / name for name in models}
        for name, path in models.items():
            copy_dir(path, sources[name])
        work = scratch / "work"
        work.mkdir()
        transfer_once(store, sources["tiny"], work)  # warm-up: bucket, connection pool
        raw: dict[str, list[dict[str, float]]] = {name: [] for name in models}
        with progress_bar() as bar:
            task = bar.add_task("checkpoint transfer", total=repeats * len(models))
            for _ in range(repeats):
                for name, source in sources.items():
                    raw[name].append(transfer_once(store, source, work))
                    bar.advance(task)
        return raw
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# -- syncs into a real server ---------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """Weights the benchmark publishes, with the probe the trainer would record for them."""

    directory: Path
    probe: dict


def perturbed_checkpoints(base: Path, scratch: Path, n: int = 2) -> list[Checkpoint]:
    """`n` different perturbations of the base weights, each with its probe (computed by
    transformers, like the trainer's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlpipe.policy.chat import load_tokenizer
    from rlpipe.policy.checkpoint import load_state_dict, save_checkpoint
    from rlpipe.trainer.probe import make_probe, probe_ids

    ids = probe_ids(load_tokenizer(base))
    state = load_state_dict(base)
    out = []
    for seed in range(1, n + 1):
        generator = torch.Generator().manual_seed(seed)
        noisy = {k: t + PERTURBATION * t.std() * torch.randn(t.shape, generator=generator) if t.ndim == 2 else t
                 for k, t in state.items()}
        directory = save_checkpoint(noisy, scratch / f"weights-{seed}", base_dir=base).path
        del noisy
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        out.append(Checkpoint(directory, make_probe(model, *ids)))
    return out


def publish(db, store, model: Path, mode: str, checkpoint: Checkpoint,  # type: ignore[no-untyped-def]
            stream=None) -> tuple[str, float]:
    """Version 0 of a new run (pause mode `mode`), published as the trainer does: the files to S3
    (timed: on a file sync's critical path), then the version row; offered by the trainer's weight
    `stream` when given (the run then syncs by stream). Returns (run id, upload seconds)."""
    from rlpipe.schemas.config import RunConfig
    from rlpipe.schemas.tables import PolicyVersion
    from rlpipe.storage.runs import register_run
    from rlpipe.weights.checkpoints import manifest_key, upload_checkpoint

    config = RunConfig.model_validate({"name": f"bench-sync-{uuid.uuid4().hex[:8]}", "model": {"path": str(model)},
                                       "sync": {"pause_mode": mode,
                                                "transport": "file" if stream is None else "stream"}})
    with db.begin() as s:
        register_run(s, config)
    t0 = time.perf_counter()
    manifest = upload_checkpoint(store, config.name, 0, 0, checkpoint.directory)
    upload_s = time.perf_counter() - t0
    if stream is not None:
        stream.offer(config.name, 0, checkpoint.directory)
    with db.begin() as s:
        s.add(PolicyVersion(run_id=config.name, version=0, trained_steps=0, checkpoint_key=manifest_key(config.name, 0),
                            sha256=manifest.weights.sha256, size_bytes=manifest.total_bytes, probe=checkpoint.probe,
                            stream_endpoint=stream.endpoint if stream is not None else None))
    return config.name, upload_s


def place_for_sidecar(checkpoint: Checkpoint, shared: Path, run_id: str) -> None:
    """Where a co-located trainer leaves a published version (it renames its directory there):
    hard links, so nothing is copied."""
    from rlpipe.weights.checkpoints import local_version_dir

    directory = local_version_dir(shared, run_id, 0)
    directory.mkdir(parents=True)
    for path in checkpoint.directory.iterdir():
        os.link(path, directory / path.name)


async def measure_syncs(stack, model: Path, checkpoints: list[Checkpoint], repeats: int,  # type: ignore[no-untyped-def]
                        scratch: Path) -> list[dict[str, Any]]:
    """Syncs into the stack's server through each path in turn (one unrecorded warm-up first)."""
    from rlpipe.infra.endpoints import resolve_endpoints
    from rlpipe.infra.inference import SERVED_MODEL_NAME
    from rlpipe.storage.db import Database
    from rlpipe.storage.object_store import ObjectStore
    from rlpipe.weights.sidecar import Sidecar
    from rlpipe.weights.stream import WeightStreamServer

    endpoints = resolve_endpoints(stack.settings)
    stream = WeightStreamServer().start()
    db, store = Database(endpoints.database_url), ObjectStore.from_endpoints(endpoints)
    url, shared = stack.service("inference-0").address(), scratch / "trainer"
    sidecars = {where: Sidecar(db, store, f"bench-{where}", url, scratch / f"sidecar-{where}",
                               model_name=SERVED_MODEL_NAME, admin_token=endpoints.inference_token,
                               shared_dir=shared if where == "shared" else None)
                for where in ("s3", "shared", "stream")}
    plan = [next(iter(PATHS))] + [label for _ in range(repeats) for label in PATHS]
    syncs: list[dict[str, Any]] = []
    try:
        with progress_bar() as bar:
            task = bar.add_task("SmolLM2 syncs", total=len(plan))
            for i, label in enumerate(plan):
                where, mode = PATHS[label]
                checkpoint = checkpoints[i % len(checkpoints)]
                run_id, upload_s = await asyncio.to_thread(publish, db, store, model, mode, checkpoint,
                                                           stream if where == "stream" else None)
                if where == "shared":
                    place_for_sidecar(checkpoint, shared, run_id)
                outcome = await sidecars[where].sync(run_id, 0)
                for root in (shared, sidecars[where].work_dir):
                    shutil.rmtree(root / run_id, ignore_errors=True)
                if i > 0:
                    syncs.append({"path": label, "status": outcome.status, "error": outcome.error,
                                  "bytes_downloaded": outcome.bytes, "probe_max_abs_diff": outcome.probe_max_abs_diff,
                                  "greedy_match": outcome.greedy_match, "upload_s": upload_s, **outcome.timings,
                                  "transport": "stream" if where == "stream" else "file",
                                  "end_to_end_s": outcome.timings["total_s"] + (0 if where == "stream" else upload_s)})
                bar.advance(task)
    finally:
        for sidecar in sidecars.values():
            await sidecar.aclose()
        stream.close()
        db.dispose()
    return syncs


def sync_table(syncs: list[dict[str, Any]], floors: dict[str, float]) -> dict[str, Any]:
    """Per path: each phase's summary, and the whole sync (publish to verified) against the floors."""
    table = {}
    for label in PATHS:
        rows = [s for s in syncs if s["path"] == label and s["status"] == "ok"]
        if rows:
            table[label] = {"n_ok": len(rows), "n": sum(s["path"] == label for s in syncs),
                            **{k: summarize([s[k] for s in rows]) for k in PHASES if all(k in s for s in rows)},
                            **{f"end_to_end_over_{floor}": summarize([s["end_to_end_s"] / t for s in rows])
                               for floor, t in floors.items()}}
    return table


def main() -> None:
    from rlpipe.infra.endpoints import resolve_endpoints
    from rlpipe.storage.object_store import ObjectStore

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="transfer repeats per model")
    parser.add_argument("--sync-repeats", type=int, default=3, help="SmolLM2 syncs per path")
    args = parser.parse_args()
    models = {"tiny": tiny_model(), "smollm2-135m": smollm2_model()}
    scratch = Path(tempfile.mkdtemp(prefix="rlpipe-bench-sync-"))
    try:
        with private_stack(inference_model=models["smollm2-135m"], only=["postgres", "seaweedfs"]) as stack:
            store = ObjectStore.from_endpoints(resolve_endpoints(stack.settings))
            raw = measure_transfers(store, models, args.repeats)
            transfers = transfer_table(raw)
            checkpoints = perturbed_checkpoints(models["smollm2-135m"], scratch)
            start_s = timed(lambda: stack.start(stack.service("inference-0"), progress=lambda msg: None))
            syncs = asyncio.run(measure_syncs(stack, models["smollm2-135m"], checkpoints, args.sync_repeats, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    small = transfers["smollm2-135m"]
    # the copies' medians, and the fastest copy of all: this VM's copies slow down by up to 10x after
    # a few GB of writes, so the fastest one is the floor a sync is held against
    floors = {"raw_copy": small["raw_copy_s"].median, "cold_copy": small["raw_copy_cold_s"].median,
              "fastest_copy": min(min(r["raw_copy_s"], r["raw_copy_cold_s"]) for r in raw["smollm2-135m"])}
    print(write_result(NAME, {"params": {"repeats": args.repeats, "sync_repeats": args.sync_repeats,
                                         "perturbation": PERTURBATION, "paths": PATHS},
                              "models": transfers, "raw": raw,
                              "server": {"model": "smollm2-135m", "bytes": small["bytes"], "start_s": start_s,
                                         "floors_s": floors, "paths": sync_table(syncs, floors), "syncs": syncs}}))


if __name__ == "__main__":
    main()
