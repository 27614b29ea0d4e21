"""Experiment trackers (TensorBoard, MLflow) fed from what Postgres committed (docs/tracking.md)."""
