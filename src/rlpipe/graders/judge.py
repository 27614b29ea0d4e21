"""A model-based grader: an LLM judge behind any OpenAI-compatible endpoint (vLLM, a hosted API).

The judge sees the task, the reference and the response through a configurable template, and the
last match of a configurable regex in its reply is its score, divided by the top score. By default
the reply is structured: the server may only generate one of the replies "SCORE: 0" .. "SCORE: 10"
(vLLM's `structured_outputs` choice constraint), so the reply parses whatever the judge model is,
even an untrained one. Free-text judging (reasoning, then the score) is the other reply format.
Greedy decoding (temperature 0), because cached grades assume the same input gets the same verdict.

A reply without a score (or an endpoint reply without choices) raises `UnparsableJudgeOutput`, and
a request the endpoint refuses (HTTP 4xx other than 408/429) raises `JudgeRequestRefused`: both are
`InvalidGrade`s, so the caller records a failure instead of inventing a reward or retrying. Other
HTTP errors and timeouts propagate as httpx errors, which are worth a retry.
"""

import asyncio
import hashlib
import os
import re
from typing import TYPE_CHECKING, Any

from rlpipe.envs.base import Task
from rlpipe.graders.base import Grader, GraderDeps, GradeResult, InvalidGrade
from rlpipe.schemas.task import GraderConfig, JudgeConfig

if TYPE_CHECKING:  # httpx loads only when a judge is built, keeping `graders` light to import
    import httpx

JUDGE_OUTPUT_CHARS = 1000  # the tail of the judge's reply kept in the details
RETRYABLE_CLIENT_ERRORS = (408, 429)  # request timeout, rate limit: the same request may pass later


class UnparsableJudgeOutput(InvalidGrade):
    """The judge's reply holds no score the configured pattern can read."""


class JudgeRequestRefused(InvalidGrade):
    """The endpoint refused the request itself (HTTP 4xx): sending it again gives the same answer."""


def endpoint_url(base_url: str, api: str) -> str:
    """The full request URL, whether or not `base_url` already ends in /v1."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return f"{base}/chat/completions" if api == "chat" else f"{base}/completions"


class JudgeGrader(Grader):
    """Score = (the judge's number) / judge.max_score, validated to lie in [0, 1]."""

    name = "judge"

    def __init__(
        self,
        config: JudgeConfig,
        client: "httpx.AsyncClient",
        *,
        timeout_s: float,
        concurrency: int,
        api_key: str | None = None,
        owns_client: bool = False,
    ) -> None:
        self.config = config
        self.client = client
        self.timeout_s = timeout_s
        self.url = endpoint_url(config.base_url, config.api)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._pattern = re.compile(config.score_pattern)
        self._slots = asyncio.Semaphore(concurrency)
        self._owns_client = owns_client
        # every judge setting can change verdicts, so all of them go into the cache key's version
        fingerprint = hashlib.sha256(config.model_dump_json().encode()).hexdigest()[:16]
        self.version = f"1+{fingerprint}"

    @classmethod
    def from_config(cls, config: GraderConfig, deps: GraderDeps) -> "JudgeGrader":
        if config.judge is None:
            raise ValueError("the judge grader needs grader.judge: set judge.base_url and judge.model")
        api_key = None
        if config.judge.api_key_env is not None:
            api_key = os.environ.get(config.judge.api_key_env)
            if not api_key:
                raise ValueError(f"judge.api_key_env names {config.judge.api_key_env!r}, which is not set")
        client, owns_client = deps.http_client, False
        if client is None:
            import httpx

            client, owns_client = httpx.AsyncClient(), True
        return cls(
            config.judge, client, timeout_s=config.timeout_s, concurrency=config.concurrency,
            api_key=api_key, owns_client=owns_client,
        )

    def _request_body(self, prompt: str) -> dict[str, Any]:
        config = self.config
        body: dict[str, Any] = {"model": config.model, "max_tokens": config.max_tokens, "temperature": 0.0}
        if config.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if config.reply_format == "structured":
            body["structured_outputs"] = {"choice": config.structured_replies()}
        return body

    async def score(self, task: Task, response_text: str) -> GradeResult:
        prompt = self.config.prompt_template.format(
            question=task.question, reference=task.reference, response=response_text
        )
        async with self._slots:
            reply = await self.client.post(
                self.url, json=self._request_body(prompt), headers=self.headers, timeout=self.timeout_s
            )
        self._raise_if_refused(reply)
        reply.raise_for_status()
        text = self._reply_text(reply)
        matches = self._pattern.findall(text)
        try:
            raw_score = float(matches[-1])
        except (IndexError, ValueError):
            raise UnparsableJudgeOutput(
                self.name, text[-JUDGE_OUTPUT_CHARS:], f"no score matching {self.config.score_pattern!r}"
            ) from None
        output = text[-JUDGE_OUTPUT_CHARS:]
        details = {"judge_model": self.config.model, "judge_score": raw_score, "judge_output": output}
        return GradeResult(raw_score / self.config.max_score, details)

    def _raise_if_refused(self, reply: "httpx.Response") -> None:
        if not 400 <= reply.status_code < 500 or reply.status_code in RETRYABLE_CLIENT_ERRORS:
            return
        hint = ""
        if self.config.reply_format == "structured":
            hint = ("; an endpoint without vLLM's structured_outputs request field needs "
                    "grader.judge.reply_format = 'free_text'")
        raise JudgeRequestRefused(
            self.name, reply.text[:JUDGE_OUTPUT_CHARS],
            f"{self.url} refused the request (HTTP {reply.status_code}){hint}"
        )

    def _reply_text(self, reply: "httpx.Response") -> str:
        try:
            choice = reply.json()["choices"][0]
            text = choice["message"]["content"] if self.config.api == "chat" else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            text = None
        if not isinstance(text, str):
            raise UnparsableJudgeOutput(
                self.name, reply.text[:JUDGE_OUTPUT_CHARS],
                f"the endpoint's reply has no choices[0] text: "
                f"is {self.url} an OpenAI-compatible {self.config.api} API?",
            )
        return text

    async def aclose(self) -> None:
        if self._owns_client:
            await self.client.aclose()
