"""The doctor's learning-signal check: the share of consumed groups with zero advantage, judged a
problem only on enough groups to tell a run that does not learn from an unlucky start."""

from __future__ import annotations

import pytest

from rlpipe.observe.doctor import MIN_GROUPS_FOR_SIGNAL, learning_signal
from rlpipe.observe.queries import GroupCounts


def counts(consumed: int, zero_std: int) -> GroupCounts:
    return GroupCounts(running=0, completed=0, consumed=consumed, dropped=0, failed=0,
                       zero_std_consumed=zero_std, uninformative_dropped=0)


@pytest.mark.parametrize(("consumed", "zero_std", "status"), [
    (0, 0, "ok"),
    (40, 10, "ok"),                                             # 25%
    (40, 24, "warn"),                                           # 60%
    (40, 36, "problem"),                                        # 90%
    (MIN_GROUPS_FOR_SIGNAL, MIN_GROUPS_FOR_SIGNAL, "problem"),  # every group, on enough of them
    (MIN_GROUPS_FOR_SIGNAL - 1, MIN_GROUPS_FOR_SIGNAL - 1, "warn"),  # every group, too few to judge
    (8, 8, "warn"),
])
def test_the_share_of_groups_without_advantage_is_judged_on_enough_groups(
        consumed: int, zero_std: int, status: str) -> None:
    finding = learning_signal(counts(consumed, zero_std))
    assert finding.status == status, finding
    if consumed and status != "ok":
        assert finding.remedy, "a finding that is not ok says what to do"


def test_too_few_groups_says_so_with_the_count() -> None:
    finding = learning_signal(counts(8, 8))
    assert "only 8 were consumed" in finding.verdict and f"fewer than {MIN_GROUPS_FOR_SIGNAL}" in finding.verdict
    assert finding.evidence == {"consumed_groups": 8, "zero_std_share": 1.0, "uninformative_dropped": 0}
