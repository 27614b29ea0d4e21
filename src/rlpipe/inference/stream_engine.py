"""The inference server's end of the sync's hot path: a vLLM weight-transfer engine that pulls a
version from the trainer's weight stream (weights/stream.py) and loads it bucket by bucket.

vLLM 0.32's own engines (NCCL, CUDA IPC) need CUDA; this one runs anywhere TCP does, so CPU
servers (and tests) take the same route a GPU fleet takes with NCCL: the sidecar drives vLLM's
`/start_weight_update` → `/update_weights` → `/finish_weight_update`, and the server's worker runs
this engine. It is registered with vLLM's factory under BACKEND when the worker imports the
server's worker extension (inference/worker_extension.py), and selected with `--weight-transfer-config`.

A sync first *stages* the version (`stage`, started through the worker extension while the server
still serves): a thread pulls it into host memory, so the pause that follows covers only the copy
into the model. Staging holds one version's bytes beside the model's; an update that finds no
staged copy of its version (or a failed one) pulls it directly, inside the pause.

Loading uses vLLM's layerwise reload, as its NCCL engine does: `start` puts the layers on the
meta device, each bucket's tensors are loaded as they arrive, `finish` processes the layers
(oneDNN repacking on CPU) and rebuilds a tied output layer's copy (refresh_tied_head).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.layerwise import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from rlpipe.weights.stream import BACKEND, StreamSource, Tensors, pull


@dataclass
class StreamInitInfo(WeightTransferInitInfo):
    """Nothing to set up ahead: every update opens its own connection to the endpoint it names."""


@dataclass
class StreamUpdateInfo(WeightTransferUpdateInfo):
    endpoint: str
    """The trainer's weight stream, "host:port"."""
    run_id: str
    version: int
    token: str | None = None
    """What the trainer's stream asks for (the servers' admin token)."""
    timeout_s: float = 600.0


class Staged:
    """One version being pulled into host memory by a thread of its own."""

    def __init__(self, source: StreamSource, dtype: torch.dtype, timeout_s: float) -> None:
        self.source = source
        self.buckets: list[Tensors] = []
        self.error: str | None = None
        self._thread = threading.Thread(target=self._pull, args=(dtype, timeout_s), name="stage-weights", daemon=True)
        self._thread.start()

    def _pull(self, dtype: torch.dtype, timeout_s: float) -> None:
        try:
            self.buckets = list(pull(self.source, dtype, timeout_s))
        except Exception as exc:  # noqa: BLE001 - reported by state(); the update then pulls directly
            self.error = f"{type(exc).__name__}: {exc}"

    def state(self) -> dict[str, Any]:
        return {"version": self.source.version, "done": not self._thread.is_alive(), "error": self.error}

    def take(self, source: StreamSource) -> list[Tensors] | None:
        """The staged buckets if they are `source`'s and complete (waiting for the pull to end)."""
        if source != self.source:
            return None
        self._thread.join()
        return None if self.error else self.buckets


class StreamWeightTransferEngine(WeightTransferEngine[StreamInitInfo, StreamUpdateInfo]):
    init_info_cls = StreamInitInfo
    update_info_cls = StreamUpdateInfo
    supports_draft_weight_update = False
    staged: Staged | None = None

    def init_transfer_engine(self, init_info: StreamInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class then synchronises an accelerator; a CPU server has none, and pull has
        # already copied every byte by the time it returns
        self.receive_weights(self.parse_update_info(update_info))

    def stage(self, update_info: StreamUpdateInfo) -> Staged:
        """Start pulling the version into host memory (returns at once; `Staged.state()` says how far)."""
        self.staged = Staged(_source(update_info), self._dtype(), update_info.timeout_s)
        return self.staged

    def receive_weights(self, update_info: StreamUpdateInfo) -> None:
        source = _source(update_info)
        staged, self.staged = self.staged, None
        buckets = staged.take(source) if staged is not None else None
        load: Any = self.model.load_weights  # vLLM models define it; nn.Module does not declare it
        for bucket in buckets if buckets is not None else pull(source, self._dtype(), update_info.timeout_s):
            load(bucket)

    def _dtype(self) -> torch.dtype:
        dtype = self.model_config.dtype  # a torch.dtype once the model has loaded ("auto" etc. resolved)
        assert isinstance(dtype, torch.dtype)
        return dtype

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_head(self.model)

    def shutdown(self) -> None:
        pass


def _source(update_info: StreamUpdateInfo) -> StreamSource:
    return StreamSource(update_info.endpoint, update_info.run_id, update_info.version, update_info.token)


def refresh_tied_head(model: torch.nn.Module) -> bool:
    """Rebuild the output layer's compute copy when it shares the embedding's weight.

    vLLM-CPU computes logits with a oneDNN copy of `lm_head.weight` made when the head is
    processed after loading; a tied head gets no tensors of its own from a checkpoint, so a
    reload refreshes the embedding but leaves the head's copy stale (SmolLM2 ties them).
    Returns whether the head is tied (and was refreshed)."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def register() -> None:
    """Make BACKEND known to vLLM's engine factory in this process (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, StreamWeightTransferEngine)
