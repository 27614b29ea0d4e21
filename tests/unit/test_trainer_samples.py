"""Stored trajectories become the trainer's samples: DAPO's overlong filtering (loss.mask_truncated)."""

from rlpipe.rl.batching import global_stats
from rlpipe.schemas.tables import Trajectory
from rlpipe.trainer.samples import TRUNCATED, to_samples, trajectory_metrics


def trajectory(finish_reason: str, loss_mask: list[int]) -> Trajectory:
    return Trajectory(prompt_ids=[1, 2], completion_ids=list(range(3, 3 + len(loss_mask))), loss_mask=loss_mask,
                      sampler_logprobs=[-0.5] * len(loss_mask), reward=1.0, group_id=7, policy_version=0,
                      finish_reason=finish_reason)


def test_truncated_completions_keep_their_tokens_but_no_loss_tokens() -> None:
    rows = [trajectory("stop", [1, 1, 0, 1]), trajectory(TRUNCATED, [1, 0, 1, 1, 1])]
    kept, masked = to_samples(rows, mask_truncated=True)
    assert kept.loss_mask == [1, 1, 0, 1]
    assert masked.loss_mask == [0] * 5 and len(masked.completion_ids) == 5 and masked.reward == 1.0
    # the step's denominators no longer count them
    assert global_stats([kept, masked], world_size=1).num_loss_tokens == 3
    assert global_stats([kept, masked], world_size=1).num_sequences == 1
    # off by default
    assert [s.loss_mask for s in to_samples(rows)] == [[1, 1, 0, 1], [1, 0, 1, 1, 1]]


def test_lengths_and_truncation_are_reported_as_sampled() -> None:
    rows = [trajectory("stop", [1, 1, 0, 1]), trajectory(TRUNCATED, [1, 0, 1, 1, 1]), trajectory("stop", [])]
    assert trajectory_metrics(rows) == {"response_length_mean": 3.5, "truncated_frac": 0.5}
