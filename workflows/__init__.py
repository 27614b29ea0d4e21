"""Deterministic orchestration: TrainingRun and RolloutGroup. No I/O, no torch/numpy here."""
