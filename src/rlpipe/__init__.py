"""rlpipe: a durable, asynchronous reinforcement-learning pipeline for LLM agents, on Temporal."""
