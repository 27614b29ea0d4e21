"""Weight-sync transfer cost against the physical floor (issue #8, item 3).

For the tiny model and SmolLM2-135M (fp32 safetensors, as the trainer publishes them): the project's
own checkpoint transfer (weights/checkpoints.py: content-addressed upload to S3 with sha256, then
a verified download into a fresh directory, on a private SeaweedFS) against a plain copy of the
same files on this machine's disk (the floor: no network stack, no hashing). Repeats alternate.

The server-side phases (pause, reload, verify) of real syncs come from the `sync_events` rows of the
async-vs-sync runs (tiny model; benchmarks/async_vs_sync.py records them). SmolLM2's server-side
phases are not measured here: starting a SmolLM2 vLLM server costs ~150 s of the 30-minute budget.

    .venv/bin/python -m benchmarks.weight_sync [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import private_stack, progress_bar, smollm2_model, summarize, timed, tiny_model, write_result

NAME = "weight_sync"


def copy_dir(src: Path, dest: Path) -> None:
    """The floor: the same files copied on the local disk."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file():
            shutil.copyfile(path, dest / path.name)


def transfer_once(store, model: Path, scratch: Path) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """One upload (fresh run id, so nothing is deduplicated), one download, one raw copy: seconds each."""
    from weights.checkpoints import download_checkpoint, upload_checkpoint

    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    manifest: list[Any] = []
    up = timed(lambda: manifest.append(upload_checkpoint(store, run_id, 1, 1, model)))
    down = timed(lambda: download_checkpoint(store, manifest[0], scratch / run_id))
    raw = timed(lambda: copy_dir(model, scratch / f"{run_id}-copy"))
    shutil.rmtree(scratch, ignore_errors=True)
    return {"upload_s": up, "download_s": down, "raw_copy_s": raw, "bytes": manifest[0].total_bytes}


def main() -> None:
    from infra.endpoints import resolve_endpoints
    from storage.object_store import ObjectStore

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    models = {"tiny": tiny_model(), "smollm2-135m": smollm2_model()}
    raw: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    with private_stack(only=["postgres", "seaweedfs"]) as stack:
        store = ObjectStore.from_endpoints(resolve_endpoints(stack.settings))
        transfer_once(store, models["tiny"], Path(tempfile.mkdtemp(prefix="rlpipe-bench-sync-")))  # warm-up: bucket, pool
        with progress_bar() as bar:
            task = bar.add_task("checkpoint transfer", total=args.repeats * len(models))
            for _ in range(args.repeats):
                for name, path in models.items():
                    raw[name].append(transfer_once(store, path, Path(tempfile.mkdtemp(prefix="rlpipe-bench-sync-"))))
                    bar.advance(task)
    table = {}
    for name, reps in raw.items():
        e2e = [r["upload_s"] + r["download_s"] for r in reps]
        table[name] = {"bytes": reps[0]["bytes"], **{k: summarize([r[k] for r in reps])
                                                     for k in ("upload_s", "download_s", "raw_copy_s")},
                       "upload_plus_download_s": summarize(e2e),
                       "ratio_to_raw_copy": summarize([t / r["raw_copy_s"] for t, r in zip(e2e, reps)]),
                       "raw_copy_mb_per_s": summarize([r["bytes"] / r["raw_copy_s"] / 1e6 for r in reps]),
                       "transfer_mb_per_s": summarize([r["bytes"] / t / 1e6 for t, r in zip(e2e, reps)])}
    print(write_result(NAME, {"params": {"repeats": args.repeats}, "models": table, "raw": raw}))


if __name__ == "__main__":
    main()
