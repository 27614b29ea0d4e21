"""Talking to vLLM servers: sampling (client) and the weight-sync endpoints (admin)."""
