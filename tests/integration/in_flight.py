"""Requests that are surely in flight when a test syncs weights into a running vLLM server.

IN_FLIGHT requests of LONG tokens at once share the server's steps and take seconds: long enough
to be still running when a sync pauses the server right after they start generating.

"Started generating" is read from vLLM's `generation_tokens_total` counter, which only ever grows,
together with the `num_requests_running` gauge: on a loaded machine the first request of a burst
can generate many tokens alone while the rest are still being sent, so tokens alone do not show
that the burst is running.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx

from rlpipe.inference.client import Completion, InferenceClient

LONG = 400  # tokens per request (the tiny model's context is 512)
IN_FLIGHT = 48  # the servers' max_num_seqs is 64
_GENERATED = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", re.M)
_RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", re.M)
_WAITING = re.compile(r"^vllm:num_requests_waiting\{[^}]*\} ([0-9.]+)$", re.M)


def start_long_requests(client: InferenceClient, prompt: list[int], count: int = IN_FLIGHT,
                        tokens: int = LONG) -> list[asyncio.Task[Completion]]:
    return [asyncio.create_task(client.complete(prompt, max_tokens=tokens, seed=i, ignore_eos=True))
            for i in range(count)]


def _metric(pattern: re.Pattern[str], text: str) -> float:
    found = pattern.search(text)
    return float(found.group(1)) if found is not None else 0.0


async def until_generating(server_url: str, tokens: int = 2 * IN_FLIGHT, running: int = IN_FLIGHT // 2,
                           timeout_s: float = 120.0) -> None:
    """Return once the server has generated `tokens` more tokens than when called and runs at
    least `running` requests (so a sync now lands mid-generation of most of the burst). Fewer
    tokens than LONG: no request of the burst can have finished yet."""
    async with httpx.AsyncClient(base_url=server_url, timeout=30) as http:
        before = _metric(_GENERATED, await _metrics(http))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = await _metrics(http)
            if _metric(_GENERATED, text) - before >= tokens and _metric(_RUNNING, text) >= running:
                return
            await asyncio.sleep(0.02)
    raise AssertionError(
        f"the server generated {_metric(_GENERATED, text) - before:.0f} of {tokens} tokens within "
        f"{timeout_s:.0f}s, running {_metric(_RUNNING, text):.0f} requests of the {running} wanted "
        f"(waiting {_metric(_WAITING, text):.0f})"
    )


async def _metrics(http: httpx.AsyncClient, attempts: int = 3) -> str:
    """The server's /metrics text. A busy server may drop the poll's kept-alive connection without
    an answer (seen once under a keep-mode race); the poll then asks again on a new one."""
    for _ in range(attempts - 1):
        try:
            return (await http.get("/metrics")).text
        except (httpx.RemoteProtocolError, httpx.ReadError):
            continue
    return (await http.get("/metrics")).text
