"""Requests that are surely in flight when a test syncs weights into a running vLLM server.

One tiny-model request finishes its 400 tokens in ~0.5 s and vLLM's `num_requests_running` gauge
is refreshed only every few engine steps, so three requests can come and go unseen. IN_FLIGHT
requests at once share the server's steps and take ~3 s: long enough to be seen running and to
still be running when a sync pauses the server right after.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx

from inference.client import Completion, InferenceClient

LONG = 400  # tokens per request (the tiny model's context is 512)
IN_FLIGHT = 48  # the servers' max_num_seqs is 64
_RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", re.M)


def start_long_requests(client: InferenceClient, prompt: list[int], count: int = IN_FLIGHT,
                        tokens: int = LONG) -> list[asyncio.Task[Completion]]:
    return [asyncio.create_task(client.complete(prompt, max_tokens=tokens, seed=i, ignore_eos=True))
            for i in range(count)]


async def until_generating(server_url: str, count: int = IN_FLIGHT // 2, timeout_s: float = 120.0) -> None:
    """Return once the server runs `count` requests (so a sync now lands mid-generation). The
    default is half of IN_FLIGHT: the gauge is sampled, and on a loaded machine the scheduler
    admits a burst over a few steps, so all IN_FLIGHT are not always seen running at once."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=server_url) as http:
        while time.monotonic() < deadline:
            running = _RUNNING.search((await http.get("/metrics")).text)
            if running is not None and float(running.group(1)) >= count:
                return
            await asyncio.sleep(0.02)
    raise AssertionError(f"the server never ran {count} requests at once within {timeout_s:.0f}s")
