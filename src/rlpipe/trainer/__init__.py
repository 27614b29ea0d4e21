"""The trainer box: the policy in memory, one optimiser step per activity, exact recovery."""
