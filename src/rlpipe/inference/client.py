"""Async client for a vLLM OpenAI-compatible server: token ids in, token ids + logprobs out.

Two routes give the same samples (same seed, same tokens, same logprobs):

- `completions`: the standard `/v1/completions`. It does not say which weights produced a
  response, so the client reads `GET /weight_info` just before and just after each request.
  The pair brackets the truth: a request that spans a weight sync reports two versions.
- `generate`: vLLM's token-in/token-out `/inference/v1/generate` (the server needs
  `--enable-scale-out`). Each response carries exact `weight_versions` spans over its
  output tokens, so a request that spans a sync in `keep` mode says which tokens came from
  which weights.

Versions are the strings given to `POST /update_weight_version` ("default" until then).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

Route = Literal["completions", "generate"]
DEFAULT_TIMEOUT_S = 600.0  # requests queue while the server is paused for a weight sync


class InferenceError(RuntimeError):
    """Base class of errors raised by the inference client and admin."""


class ServerUnavailableError(InferenceError):
    """The server could not be reached (down, starting, wrong address)."""


class InferenceTimeoutError(InferenceError):
    """The server accepted the connection but did not answer in time."""


KEEPALIVE_EXPIRY_S = 2.0
"""How long an idle connection to a server is kept for reuse: below the server's keep-alive timeout."""


class ResponseLostError(InferenceError):
    """The server took the request but closed the connection without an answer.

    vLLM does this for some failing calls (a failed `/collective_rpc`) and when it crashes;
    its log says which.
    """


class RequestRejectedError(InferenceError):
    """The server answered with an error status; `status` and `body` say why."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url} answered {status}: {body[:500]}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class WeightSpan:
    """Output tokens [start, end) were sampled with the weights labelled `version`."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt.

    `logprobs[i]` is the sampler's log-probability of `token_ids[i]` under the distribution it
    sampled from (the server runs `--logprobs-mode processed_logprobs`: after temperature and
    top-p). `weight_version` is the oldest version that may have produced a token (use it for
    staleness), `last_weight_version` the newest; they differ only for a request that spanned
    a sync. `weight_spans` is exact per-token attribution, from the `generate` route only.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos or stop token), "length", "abort"
    text: str  # without a final stop token; "" on the generate route (no detokenisation)
    weight_version: str
    last_weight_version: str
    weight_spans: tuple[WeightSpan, ...] | None = None


class InferenceClient:
    """One server, one connection pool; use as `async with InferenceClient(...) as client`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        route: Route = "completions",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_connections: int = 256,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.route = route
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            # drop idle connections well before vLLM's uvicorn does (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): at
            # httpx's default of 5 s too, a request sent on a connection the server is closing is lost
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def complete(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
    ) -> Completion:
        """Sample one continuation of `prompt_ids` (a per-request `seed` makes it reproducible).

        Stop tokens are kept at the end of `token_ids` (with their logprobs): the trainer
        must see the eos it is trained to emit. `ignore_eos` forces `max_tokens` tokens
        (benchmarks, and tests that need a request to outlast a weight sync).
        """
        sampling: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "stop_token_ids": list(stop_token_ids),
            # stop strings (an environment's closing tags) stay in the output: without them a
            # tool call would read as unterminated, and the tokens must be what was sampled
            "stop": list(stop),
            "include_stop_str_in_output": bool(stop),
            "logprobs": 0,  # 0 = only the sampled token's logprob
            "ignore_eos": ignore_eos,
            "skip_special_tokens": False,
        }
        if self.route == "generate":
            return await self._complete_generate(prompt_ids, sampling)
        return await self._complete_completions(prompt_ids, sampling)

    async def score(self, token_ids: Sequence[int]) -> list[float]:
        """Teacher-forced log p(token_ids[i] | token_ids[:i]) for i >= 1 (len - 1 values).

        Computed by the server from the raw logits (prompt logprobs skip temperature and top-p),
        so they compare directly with the trainer's log-softmax: this verifies a weight sync.
        """
        body = {
            "model": self.model,
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,  # 0 = only the actual token's logprob
        }
        choice = (await self._post("/v1/completions", body))["choices"][0]
        scored = choice["prompt_logprobs"][1:]  # position 0 has no context
        return [entry[str(token)]["logprob"] for entry, token in zip(scored, token_ids[1:], strict=True)]

    async def weight_version(self) -> str:
        """The label of the weights the server holds now (`POST /update_weight_version`)."""
        return str((await self._get("/weight_info"))["weight_version"])

    async def _complete_completions(self, prompt_ids: Sequence[int], sampling: dict[str, Any]) -> Completion:
        body = {"model": self.model, "prompt": list(prompt_ids), "return_token_ids": True, **sampling}
        before = await self.weight_version()
        choice = (await self._post("/v1/completions", body))["choices"][0]
        after = await self.weight_version()
        token_ids = list(choice["token_ids"])
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        return Completion(
            token_ids=token_ids,
            logprobs=[_as_logprob(lp) for lp in logprobs],
            finish_reason=choice["finish_reason"] or "abort",
            text=choice["text"],
            weight_version=before,
            last_weight_version=after,
        )

    async def _complete_generate(self, prompt_ids: Sequence[int], sampling: dict[str, Any]) -> Completion:
        body = {"model": self.model, "token_ids": list(prompt_ids), "sampling_params": sampling}
        choice = (await self._post("/inference/v1/generate", body))["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        spans = tuple(WeightSpan(s["version"], s["start"], s["end"]) for s in choice.get("weight_versions") or [])
        if not spans:  # nothing generated (aborted before the first token): ask the server
            version = await self.weight_version()
            spans = (WeightSpan(version, 0, 0),)
        return Completion(
            token_ids=list(choice["token_ids"] or []),
            logprobs=[_as_logprob(entry["logprob"]) for entry in content],
            finish_reason=choice["finish_reason"] or "abort",
            text="",
            weight_version=spans[0].version,
            last_weight_version=spans[-1].version,
            weight_spans=spans,
        )

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await request_json(self._http, "POST", path, json=body)

    async def _get(self, path: str) -> dict[str, Any]:
        return await request_json(self._http, "GET", path)


async def request_json(http: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    """One HTTP call turned into JSON or one of the errors above, each naming the URL."""
    url = f"{http.base_url}{path}"
    try:
        response = await http.request(method, path, **kwargs)
    except (httpx.ConnectError, httpx.ConnectTimeout) as err:
        raise ServerUnavailableError(f"cannot reach inference server at {url}: {err!r}") from err
    except httpx.TimeoutException as err:
        raise InferenceTimeoutError(f"{method} {url} timed out ({type(err).__name__})") from err
    except httpx.TransportError as err:
        raise ResponseLostError(f"{method} {url} got no answer: {err!r}") from err
    if response.status_code >= 400:
        raise RequestRejectedError(url, response.status_code, response.text)
    if not response.content:
        return {}
    return response.json()


def _as_logprob(logprob: float | None) -> float:
    """A logprob from JSON; vLLM's schema allows null, read here as -inf (no probability)."""
    return -math.inf if logprob is None else float(logprob)
