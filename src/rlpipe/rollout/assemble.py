"""A trajectory from its turns: the token sequence the trainer sees, with its loss mask.

    completion = out_0 + in_1 + out_1 + in_2 + out_2 + ...
    loss_mask  =  1…1  + 0…0  +  1…1  + 0…0  +  1…1          (model tokens 1, tool/env tokens 0)
    logprobs   = lp_0  + 0…0  + lp_1  + …                    (sampler logprobs; 0 where masked)

`in_k` (k ≥ 1) are the tool-observation tokens appended before turn k; `in_0` is the prompt.
Nothing is re-tokenised: the ids are exactly what the sampler saw and produced.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlpipe.schemas.trajectory import AssembledTrajectory, TurnTokens


def assemble(turns: Sequence[TurnTokens]) -> AssembledTrajectory:
    """Concatenate turns (ordered by turn index) into one masked completion."""
    if not turns:
        raise ValueError("a trajectory needs at least one turn")
    out = AssembledTrajectory(prompt_ids=list(turns[0].input_ids))
    for index, turn in enumerate(turns):
        if len(turn.output_ids) != len(turn.output_logprobs):
            raise ValueError(f"turn {index}: {len(turn.output_ids)} output ids but "
                             f"{len(turn.output_logprobs)} logprobs")
        if index > 0:  # observation tokens: context for the model, not its actions
            out.completion_ids += turn.input_ids
            out.loss_mask += [0] * len(turn.input_ids)
            out.sampler_logprobs += [0.0] * len(turn.input_ids)
        start = len(out.completion_ids)
        out.completion_ids += turn.output_ids
        out.loss_mask += [1] * len(turn.output_ids)
        out.sampler_logprobs += turn.output_logprobs
        for version, first, end in turn.version_spans or []:
            _append_span(out.version_spans, [version, start + first, start + end])
    return out


def _append_span(spans: list[list[int]], span: list[int]) -> None:
    if spans and spans[-1][0] == span[0]:
        spans[-1][2] = span[2]  # same version continues (across masked observation tokens too)
    else:
        spans.append(span)
