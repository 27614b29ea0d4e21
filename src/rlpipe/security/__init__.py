"""Payload protection: Temporal payloads encrypted with a key from the environment."""
