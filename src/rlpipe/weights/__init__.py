"""Weights: publishing checkpoints (trainer -> S3) and syncing them into inference servers."""
