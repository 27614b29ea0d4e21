"""Which vLLM routes the admin guard leaves open (generation, probes) and which need the token."""

from __future__ import annotations

import pytest

from rlpipe.inference.admin_guard import TOKEN_ENV, AdminGuard, is_public


@pytest.mark.parametrize("path", ["/health", "/metrics", "/weight_info", "/v1/completions", "/v1/models",
                                  "/v1/chat/completions", "/inference/v1/generate"])
def test_generation_and_probes_are_open(path: str) -> None:
    assert is_public(path)


@pytest.mark.parametrize("path", ["/pause", "/resume", "/is_paused", "/collective_rpc", "/update_weight_version",
                                  "/reset_prefix_cache", "/sleep", "/update_weights", "/inference/v1/abort_requests",
                                  "/v1/load_lora_adapter", "/server_info", "/docs", "/some_route_vllm_adds_later"])
def test_admin_and_unknown_routes_need_the_token(path: str) -> None:
    assert not is_public(path)


async def test_a_server_without_a_token_refuses_to_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("never reached")

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=TOKEN_ENV):
        AdminGuard(app)
