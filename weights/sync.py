"""Loading a published version into one running inference server, verified.

    look up the version ─▶ download + check sha256 ─▶ pause ─▶ reload ─▶ label "verifying-v"
    ─▶ reset prefix cache ─▶ resume ─▶ score the probe ─▶ match? label v : roll back

A checkpoint whose bytes do not hash to the published sha256 is refused before the server is
paused. While the new weights are being verified they carry the label `verifying-<v>`, which
is no published version: a rollout that samples in that window sees it and is retried, so no
trajectory ever records weights that were not verified. A probe mismatch (the server computes
other logprobs than the trainer did for that version) reloads the previous weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from inference.admin import InferenceAdmin, PauseMode
from inference.client import InferenceClient
from storage.object_store import DigestMismatch, ObjectStore
from weights.checkpoints import Manifest, download_checkpoint, load_manifest

VERIFYING = "verifying-"


@dataclass
class SyncOutcome:
    status: str
    """ok | refused (bad checkpoint, server untouched) | rolled_back (probe mismatch) | failed"""
    bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    probe_max_abs_diff: float | None = None
    greedy_match: bool | None = None
    error: str | None = None


@dataclass(frozen=True)
class VersionToLoad:
    run_id: str
    version: int
    checkpoint_key: str
    sha256: str
    probe: dict | None


@dataclass(frozen=True)
class LoadedVersion:
    version: int
    directory: Path


def fetch(store: ObjectStore, target: VersionToLoad, directory: Path) -> tuple[Manifest, int]:
    """Download the version's files, each checked against its digest; raise DigestMismatch for a
    checkpoint that is not what the trainer published."""
    manifest = load_manifest(store, target.checkpoint_key)
    if manifest.weights.sha256 != target.sha256:
        raise DigestMismatch(f"manifest of version {target.version} names weights {manifest.weights.sha256}, "
                             f"but the version was published with {target.sha256}")
    return manifest, download_checkpoint(store, manifest, directory)


async def probe_logprob_diff(client: InferenceClient, probe: dict) -> float:
    """Largest |server - trainer| logprob over the probe's tokens."""
    served = await client.score(probe["token_ids"])
    return max(abs(a - b) for a, b in zip(served, probe["logprobs"], strict=True))


async def probe_greedy_matches(client: InferenceClient, probe: dict) -> bool:
    """Does the server's greedy continuation of the probe prompt equal the trainer's?"""
    served = await client.complete(probe["prompt_ids"], max_tokens=len(probe["greedy_ids"]), temperature=0.0,
                                   ignore_eos=True)
    return served.token_ids == probe["greedy_ids"]


async def load_into_server(admin: InferenceAdmin, client: InferenceClient, target: VersionToLoad, directory: Path,
                           previous: LoadedVersion | None, mode: PauseMode, tolerance: float | None) -> SyncOutcome:
    """Swap the server's weights for `directory` (already fetched); verify; roll back on mismatch."""
    outcome = SyncOutcome(status="ok")
    t = time.monotonic()
    await admin.pause(mode)
    paused = time.monotonic()
    await _swap(admin, directory, f"{VERIFYING}{target.version}", reset_running=mode == "keep")
    outcome.timings["reload_s"] = time.monotonic() - paused
    await admin.resume()
    outcome.timings["pause_s"] = time.monotonic() - t
    t = time.monotonic()
    if tolerance is not None and target.probe:
        outcome.probe_max_abs_diff = await probe_logprob_diff(client, target.probe)
        outcome.greedy_match = await probe_greedy_matches(client, target.probe)
    outcome.timings["verify_s"] = time.monotonic() - t
    mismatch = _mismatch(outcome, tolerance)
    if mismatch:
        outcome.status = "rolled_back"
        outcome.error = f"{mismatch}: the server did not load version {target.version} faithfully"
        if previous is not None:
            await admin.pause(mode)
            await _swap(admin, previous.directory, str(previous.version), reset_running=mode == "keep")
            await admin.resume()
        return outcome
    await admin.update_weight_version(target.version)
    return outcome


def _mismatch(outcome: SyncOutcome, tolerance: float | None) -> str | None:
    if outcome.probe_max_abs_diff is not None and outcome.probe_max_abs_diff > (tolerance or 0):
        return f"probe logprobs differ from the trainer's by up to {outcome.probe_max_abs_diff:.2e} (tolerance {tolerance})"
    if outcome.greedy_match is False:
        return "the greedy continuation of the probe differs from the trainer's"
    return None


async def _swap(admin: InferenceAdmin, directory: Path, label: str, reset_running: bool) -> None:
    await admin.reload_weights(directory)
    await admin.update_weight_version(label)
    await admin.reset_prefix_cache(reset_running=reset_running)
