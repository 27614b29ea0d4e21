"""Rollouts: building token-in/token-out context, one model turn, and assembling trajectories."""
