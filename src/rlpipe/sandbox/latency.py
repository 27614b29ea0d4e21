"""Injected tool-call latency: emulate remote sandboxes and their long tail on a local machine.

A local sandbox answers in milliseconds; a remote one (a sandbox service, a container cluster) takes
hundreds of milliseconds with a heavy tail, and that tail is what makes an asynchronous pipeline pay off.
Each model is deterministic: the same config (and seed) gives the same sequence of delays. The delay is
awaited with asyncio.sleep, so one worker can hold many delayed calls at once.
"""

import asyncio
import math
import random
from collections.abc import Callable
from itertools import cycle
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class NoLatency(BaseModel):
    """No delay: the sandbox's own latency only."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["none"] = "none"


class ConstantLatency(BaseModel):
    """The same delay before every call (a fixed network round trip)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["constant"] = "constant"
    seconds: float = Field(ge=0, allow_inf_nan=False)


class LognormalLatency(BaseModel):
    """exp(N(ln median, sigma²)): the usual shape of service latency; sigma ~1 gives a p99 ~10x the median."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["lognormal"] = "lognormal"
    median_seconds: float = Field(gt=0, allow_inf_nan=False)
    sigma: float = Field(ge=0, allow_inf_nan=False)
    """Spread of ln(delay); 0 makes every delay the median."""
    seed: int = 0
    """Seeds the delay sequence, so a run can be replayed."""
    max_seconds: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Cap on a single delay (a client-side timeout would cut the tail here); None keeps the full tail."""


class TraceLatency(BaseModel):
    """Delays recorded from a real sandbox service, replayed in order and cyclically."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["trace"] = "trace"
    seconds: tuple[Annotated[float, Field(ge=0, allow_inf_nan=False)], ...] = Field(min_length=1)


LatencyModel = Annotated[NoLatency | ConstantLatency | LognormalLatency | TraceLatency,
                         Field(discriminator="kind")]


def delay_sampler(model: NoLatency | ConstantLatency | LognormalLatency | TraceLatency) -> Callable[[], float]:
    """A function returning the model's next delay in seconds; it owns the model's RNG or trace cursor."""
    match model:
        case NoLatency():
            return lambda: 0.0
        case ConstantLatency(seconds=seconds):
            return lambda: seconds
        case LognormalLatency(median_seconds=median, sigma=sigma, seed=seed, max_seconds=cap):
            rng, mu = random.Random(seed), math.log(median)
            return lambda: min(rng.lognormvariate(mu, sigma), cap if cap is not None else math.inf)
        case TraceLatency(seconds=trace):
            replay = cycle(trace)
            return lambda: next(replay)
    raise AssertionError(f"unhandled latency model {model!r}")


class LatencyInjector:
    """Draws the next delay of a latency model and sleeps it; one instance per sandbox, shared by its calls."""

    def __init__(self, model: NoLatency | ConstantLatency | LognormalLatency | TraceLatency) -> None:
        self.model = model
        self._next = delay_sampler(model)

    def next_delay(self) -> float:
        """The next delay in seconds; calls consume the sequence in order."""
        return self._next()

    async def sleep(self) -> float:
        """Await the next delay without blocking the event loop; returns the seconds slept."""
        delay = self.next_delay()
        if delay > 0:
            await asyncio.sleep(delay)
        return delay
