"""Loading one version into one running inference server, verified.

  [stream: stage] ─▶ pause ─▶ load ─▶ label "verifying-<v>-<attempt>" ─▶ reset prefix cache ─▶ resume
          ─▶ probe: teacher-forced logprobs within tolerance AND greedy continuation equal
          ─▶ record the verdict ─▶ label v            (or roll back to the previous weights)

The load reads a fetched checkpoint directory (vLLM's reload), or takes the version from the
trainer's stream (weights/stream.py) through the server's weight-transfer engine, which stages it
in host memory while the server still serves, so the pause covers only the copy into the model.

Why each rule:
- The verdict is recorded before the label leaves the verifying one, so a rollout holding
  tokens with that label always finds it (weights/labels.py).
- A reload that fails part-way leaves layers on the meta device and the next generation kills
  the engine (docs/vllm-cpu-notes.md): the server is never resumed on it. The previous weights
  are reloaded while still paused; if that fails too, the server stays paused and
  ServerLeftPaused says so.
- A probe that moved less than the tolerance since the previous weights cannot tell the two
  apart: the sync still passes (the weights agree with the trainer's to within tolerance either
  way), but the outcome says the check was inconclusive.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlpipe.inference.admin import InferenceAdmin, PauseMode
from rlpipe.inference.client import InferenceClient, InferenceError
from rlpipe.weights.labels import published_label
from rlpipe.weights.stream import StreamSource

log = logging.getLogger("rlpipe.sync")

Source = Path | StreamSource
"""Where a server loads weights from: a checkpoint directory on its machine, or the trainer's stream."""


@dataclass(frozen=True)
class Weights:
    """Weights a server can be loaded with: a directory on the server's machine or the trainer's
    stream, and the label they carry once loaded (a published version, or "default" for the
    server's start-up weights)."""

    label: str
    source: Source
    run_id: str | None = None
    version: int | None = None
    probe: dict | None = None
    """The trainer's probe for these weights (published versions only)."""


@dataclass(frozen=True)
class SyncPlan:
    version: int
    source: Source
    probe: dict | None
    label: str
    """What the server is labelled while the weights are verified (a published label when not)."""
    previous: Weights
    """What the server goes back to if the new weights fail."""
    mode: PauseMode
    tolerance: float | None
    """Largest allowed |server - trainer| probe logprob; None skips verification."""


@dataclass
class SyncOutcome:
    status: str
    """ok | refused (bad checkpoint, server untouched) | rolled_back (probe mismatch) | failed (reload failed)"""
    bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    probe_max_abs_diff: float | None = None
    probe_tolerance: float | None = None
    greedy_match: bool | None = None
    error: str | None = None
    """What went wrong, or why an ok verification proves less than usual (inconclusive)."""


class ServerLeftPaused(InferenceError):
    """Neither the new nor the previous weights could be reloaded: the server stays paused, since
    a resumed engine would crash on its half-loaded layers."""


RecordVerdict = Callable[[SyncOutcome], Awaitable[None]]


async def load_into_server(admin: InferenceAdmin, client: InferenceClient, plan: SyncPlan,
                           record_verdict: RecordVerdict) -> SyncOutcome:
    """Swap the server's weights for `plan.source`, verify them, and roll back on failure.
    `record_verdict` stores the outcome; it is called once, before the server's label leaves
    `plan.label` (on success the label then becomes the published version)."""
    outcome = SyncOutcome(status="ok")
    keep = plan.mode == "keep"
    if isinstance(plan.source, StreamSource):  # pulled while the server still serves: the pause only loads
        staging = time.monotonic()
        not_staged = await admin.stage_weights(plan.source)
        outcome.timings["stage_s"] = time.monotonic() - staging
        if not_staged:
            log.warning("staging version %d failed (%s): it is pulled inside the pause", plan.version, not_staged)
    started = time.monotonic()
    await admin.pause(plan.mode)
    paused = time.monotonic()
    try:
        await _swap(admin, plan.source, plan.label, keep)
    except InferenceError as exc:
        return await _recover_from_failed_reload(admin, plan, outcome, exc, record_verdict)
    outcome.timings["reload_s"] = time.monotonic() - paused
    await admin.resume()
    outcome.timings["pause_s"] = time.monotonic() - started
    if plan.tolerance is None or not plan.probe:
        await record_verdict(outcome)
        if plan.label != published_label(plan.version):
            await admin.update_weight_version(published_label(plan.version))
        return outcome
    checked = time.monotonic()
    outcome.probe_max_abs_diff, outcome.probe_tolerance = await probe_logprob_diff(client, plan.probe), plan.tolerance
    outcome.greedy_match = await probe_greedy_matches(client, plan.probe, plan.tolerance)
    outcome.timings["verify_s"] = time.monotonic() - checked
    mismatch = _mismatch(outcome, plan.tolerance)
    if mismatch:
        outcome.status = "rolled_back"
        outcome.error = (f"{mismatch}: the server did not load version {plan.version} faithfully; "
                         f"rolled back to {plan.previous.label}")
        await record_verdict(outcome)
        await admin.pause(plan.mode)
        await _restore_or_stay_paused(admin, plan)
        await admin.resume()
        return outcome
    outcome.error = _inconclusive(plan)
    await record_verdict(outcome)
    await admin.update_weight_version(published_label(plan.version))
    return outcome


async def _recover_from_failed_reload(admin: InferenceAdmin, plan: SyncPlan, outcome: SyncOutcome,
                                      exc: InferenceError, record_verdict: RecordVerdict) -> SyncOutcome:
    """Still paused: reload the previous weights, and resume only if that worked."""
    outcome.status = "failed"
    outcome.error = f"reloading version {plan.version} failed ({exc})"
    try:
        await _restore_or_stay_paused(admin, plan)
    except ServerLeftPaused as again:
        outcome.error += f"; {again}"
        await record_verdict(outcome)
        raise
    await admin.resume()
    outcome.error += f"; back on {plan.previous.label}"
    await record_verdict(outcome)
    return outcome


async def probe_logprob_diff(client: InferenceClient, probe: dict) -> float:
    """Largest |server - trainer| logprob over the probe's tokens."""
    served = await client.score(probe["token_ids"])
    return max(abs(a - b) for a, b in zip(served, probe["logprobs"], strict=True))


async def probe_greedy_matches(client: InferenceClient, probe: dict, tolerance: float = 0.0) -> bool | None:
    """Does the server's greedy continuation of the probe prompt equal the trainer's, up to the first
    near-tie (`comparable_greedy_tokens`)? None when the very first token is one: no evidence."""
    comparable = comparable_greedy_tokens(probe, tolerance)
    if comparable == 0:
        return None
    served = await client.complete(probe["prompt_ids"], max_tokens=comparable, temperature=0.0, ignore_eos=True)
    return served.token_ids == probe["greedy_ids"][:comparable]


def comparable_greedy_tokens(probe: dict, tolerance: float) -> int:
    """How many leading greedy tokens of `probe` a server within `tolerance` must reproduce: those
    before the first near-tie, a token that leads the runner-up by at most `tolerance` (all of them
    for a probe recorded without margins). The bounds are ~3x a faithful server's worst logprob
    noise (weights/tolerance.py), so a faithful server's gap between two logits is off by at most
    ~2/3 of the bound and cannot flip a token that leads by more."""
    margins = probe.get("greedy_margins") or [math.inf] * len(probe["greedy_ids"])
    return next((i for i, margin in enumerate(margins) if margin <= tolerance), len(margins))


def probe_movement(probe: dict | None, previous: dict | None) -> float | None:
    """How far the trainer's probe logprobs moved between two versions (None if not comparable)."""
    if not probe or not previous or probe["token_ids"] != previous["token_ids"]:
        return None
    return max(abs(a - b) for a, b in zip(probe["logprobs"], previous["logprobs"], strict=True))


def _mismatch(outcome: SyncOutcome, tolerance: float) -> str | None:
    if outcome.probe_max_abs_diff is not None and outcome.probe_max_abs_diff > tolerance:
        return (f"probe logprobs differ from the trainer's by up to {outcome.probe_max_abs_diff:.2e} "
                f"(tolerance {tolerance})")
    if outcome.greedy_match is False:
        return "the greedy continuation of the probe differs from the trainer's"
    return None


def _inconclusive(plan: SyncPlan) -> str | None:
    """A note when the check could not have told the new weights from the previous ones: the probe's
    logprobs moved less than the bound and its compared greedy tokens did not change."""
    moved = probe_movement(plan.probe, plan.previous.probe)
    if moved is None or moved > (plan.tolerance or 0):
        return None
    assert plan.probe is not None and plan.previous.probe is not None  # probe_movement compared them
    compared = comparable_greedy_tokens(plan.probe, plan.tolerance or 0)
    if plan.previous.probe["greedy_ids"][:compared] != plan.probe["greedy_ids"][:compared]:
        return None
    return (f"inconclusive: the trainer's probe moved only {moved:.2e} since {plan.previous.label} (tolerance "
            f"{plan.tolerance}), so the check cannot tell the two apart; both agree with version {plan.version}")


async def _restore_or_stay_paused(admin: InferenceAdmin, plan: SyncPlan) -> None:
    """Reload the previous weights (the server is paused); raise ServerLeftPaused if that fails."""
    try:
        await _swap(admin, plan.previous.source, plan.previous.label, keep=plan.mode == "keep")
    except InferenceError as exc:
        raise ServerLeftPaused(f"reloading {plan.previous.label} from {plan.previous.source} failed too ({exc}): "
                               "the server stays paused") from exc


async def _swap(admin: InferenceAdmin, source: Source, label: str, keep: bool) -> None:
    """Load while paused (from disk, or streamed by the server's weight-transfer engine), label,
    and drop the KV computed by the old weights (keep mode: preempt the kept requests too, so
    their KV is recomputed with the new weights)."""
    if isinstance(source, StreamSource):
        await admin.stream_weights(source)
    else:
        await admin.reload_weights(source)
    await admin.update_weight_version(label)
    await admin.reset_prefix_cache(reset_running=keep)
