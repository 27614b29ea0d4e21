"""The inference servers' admin routes answer only the token holder (inference/admin_guard.py), on the
session's real vLLM server; generation for rollouts stays open. The test leaves the server resumed,
holding the base weights under the label it found."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rlpipe.inference.admin import InferenceAdmin
from rlpipe.inference.admin_guard import bearer
from rlpipe.inference.client import InferenceClient, RequestRejectedError
from rlpipe.infra.inference import SERVED_MODEL_NAME

pytestmark = pytest.mark.vllm

PROMPT = [5, 6, 7, 8]


async def test_admin_routes_refuse_callers_without_the_token(spare_server: str, spare_server_token: str,
                                                             tiny_model: Path) -> None:
    reload = {"method": "reload_weights_tied", "kwargs": {"weights_path": str(tiny_model)}}
    async with httpx.AsyncClient(base_url=spare_server, timeout=120) as http:
        anonymous = [await http.post("/pause", params={"mode": "abort"}),
                     await http.post("/collective_rpc", json=reload),
                     await http.post("/update_weight_version", json={"new_version": "forged"}),
                     await http.post("/resume")]
        forged = await http.post("/pause", params={"mode": "abort"}, headers=bearer("not-the-token"))
        public = [await http.get("/health"), await http.get("/weight_info"), await http.get("/v1/models")]
    assert [r.status_code for r in anonymous] == [401] * 4, [r.text for r in anonymous]
    assert forged.status_code == 403 and "admin route" in forged.text
    assert [r.status_code for r in public] == [200] * 3

    async with InferenceAdmin(spare_server, token=None) as stranger:  # the sidecar's client, without a token
        with pytest.raises(RequestRejectedError) as refused:
            await stranger.pause("abort")
    assert refused.value.status == 401

    async with InferenceAdmin(spare_server, token=spare_server_token) as admin, \
            InferenceClient(spare_server, SERVED_MODEL_NAME, route="generate") as client:
        label = await admin.weight_version()
        assert label != "forged" and not await admin.is_paused()  # the refused calls changed nothing
        before = await client.complete(PROMPT, max_tokens=4, seed=1)
        await admin.pause("abort")
        try:
            assert await admin.is_paused()
            await admin.reload_weights(tiny_model)
            await admin.update_weight_version(label)
            await admin.reset_prefix_cache()
        finally:
            await admin.resume()
        assert not await admin.is_paused()
        assert await client.complete(PROMPT, max_tokens=4, seed=1) == before  # rollouts generate, no token
