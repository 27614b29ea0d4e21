"""The token-level shapes of a trajectory, shared by the rollout box that assembles them
(`rlpipe.rollout.assemble`) and the buffer that stores them (`rlpipe.storage.buffer`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TurnTokens:
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    version_spans: list[list[int]] | None = None
    """[[version, first, end), ...] over output_ids (relative to this turn's output)."""


@dataclass
class AssembledTrajectory:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    version_spans: list[list[int]] = field(default_factory=list)
    """[[version, first, end), ...] over completion_ids, merged where adjacent spans agree."""

    @property
    def min_version(self) -> int | None:
        return min((span[0] for span in self.version_spans), default=None)
