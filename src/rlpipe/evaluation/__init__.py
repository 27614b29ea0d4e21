"""Held-out evaluation of published policy versions through an inference server."""
