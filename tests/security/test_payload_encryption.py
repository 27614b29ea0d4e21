"""Payload encryption: what Temporal stores is ciphertext without the key; the codec (and the
codec server the Web UI asks) decodes it with the key."""

from __future__ import annotations

import base64
import json
import os
import threading
import uuid

import httpx
import pytest
from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads
from temporalio.client import Client

from rlpipe.security.codec import ENCODING, EncryptionCodec, PayloadKeyError
from rlpipe.security.codec_server import serve
from rlpipe.workers.common import data_converter

SECRET_TEXT = "the-prompt-nobody-should-read"


@pytest.fixture
def key_env(monkeypatch: pytest.MonkeyPatch) -> EncryptionCodec:
    monkeypatch.setenv("RLPIPE_PAYLOAD_KEY", base64.b64encode(os.urandom(32)).decode())
    codec = EncryptionCodec.from_environment()
    assert codec is not None
    return codec


async def test_codec_round_trip_and_wrong_key(key_env: EncryptionCodec) -> None:
    payloads = data_converter().payload_converter.to_payloads([{"prompt": SECRET_TEXT}])
    encoded = await key_env.encode(payloads)
    assert encoded[0].metadata["encoding"] == ENCODING and SECRET_TEXT.encode() not in encoded[0].data
    assert await key_env.decode(encoded) == payloads
    with pytest.raises(PayloadKeyError, match="encrypted with key"):
        await EncryptionCodec(os.urandom(32)).decode(encoded)
    with pytest.raises(PayloadKeyError, match="32 bytes"):
        EncryptionCodec(b"short")


async def stored_history_bytes(address: str, client: Client) -> tuple[bytes, object]:
    """Start a parked workflow whose input holds SECRET_TEXT; return what the server stores."""
    workflow_id = f"payload-{uuid.uuid4()}"
    handle = await client.start_workflow("NoSuchWorkflow", {"prompt": SECRET_TEXT}, id=workflow_id,
                                         task_queue=f"nobody-{uuid.uuid4()}")
    try:
        plain = await Client.connect(address)  # a reader without the key
        history = await plain.get_workflow_handle(workflow_id).fetch_history()
        raw = b"".join(event.SerializeToString() for event in history.events)
        return raw, history.events[0].workflow_execution_started_event_attributes.input.payloads[0]
    finally:
        await handle.terminate("test done")


@pytest.mark.stack
async def test_temporal_stores_only_ciphertext(key_env: EncryptionCodec, endpoints, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    encrypted = await Client.connect(endpoints.temporal_address, data_converter=data_converter())
    raw, stored = await stored_history_bytes(endpoints.temporal_address, encrypted)
    assert stored.metadata["encoding"] == ENCODING and SECRET_TEXT.encode() not in raw
    (decoded,) = await key_env.decode([stored])
    assert json.loads(decoded.data)["prompt"] == SECRET_TEXT
    # control: without the key the same input is stored readable (the check above can fail)
    monkeypatch.delenv("RLPIPE_PAYLOAD_KEY")
    readable = await Client.connect(endpoints.temporal_address, data_converter=data_converter())
    raw, _ = await stored_history_bytes(endpoints.temporal_address, readable)
    assert SECRET_TEXT.encode() in raw


def test_codec_server_decodes_for_the_ui(key_env: EncryptionCodec) -> None:
    import asyncio

    payloads = data_converter().payload_converter.to_payloads([SECRET_TEXT])
    encrypted = asyncio.run(key_env.encode(payloads))
    server = serve(key_env, "127.0.0.1", 0, "http://127.0.0.1:18233")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        body = json_format.MessageToJson(Payloads(payloads=encrypted))
        answer = httpx.post(f"http://127.0.0.1:{server.server_port}/decode", content=body,
                            headers={"content-type": "application/json", "origin": "http://127.0.0.1:18233"})
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "http://127.0.0.1:18233"
        decoded = json_format.Parse(answer.content, Payloads())
        assert json.loads(decoded.payloads[0].data) == SECRET_TEXT
    finally:
        server.shutdown()
