"""The trainer's weight stream (weights/stream.py) over real TCP on loopback: what a server's
weight-transfer engine pulls is the published file's tensors, in the dtype it asks for, bucket by
bucket, and a bucket altered in flight is refused before any of its tensors is handed over."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlpipe.policy.checkpoint import WEIGHTS_FILE
from rlpipe.weights.stream import BucketCorrupted, StreamError, StreamSource, WeightStreamServer, offered, pull
from tests.flipping_proxy import FlippingProxy

BUCKET = 64 * 1024
TOKEN = "the-servers-admin-token"


@pytest.fixture
def published(tmp_path: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.weight": torch.randn(64, 96, generator=generator) for i in range(6)}
    tensors |= {"norm.weight": torch.randn(7, generator=generator), "positions": torch.arange(5)}
    save_file(tensors, tmp_path / WEIGHTS_FILE)
    return tensors


@pytest.fixture
def stream(tmp_path: Path, published: dict[str, torch.Tensor]) -> Iterator[WeightStreamServer]:
    server = WeightStreamServer(token=TOKEN, bucket_bytes=BUCKET).start()
    server.offer("run", 3, tmp_path)
    yield server
    server.close()


def pulled(source: StreamSource, dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], int]:
    tensors: dict[str, torch.Tensor] = {}
    buckets = 0
    for bucket in pull(source, dtype):
        tensors.update(bucket)
        buckets += 1
    return tensors, buckets


def test_a_pull_delivers_the_published_tensors_exactly_in_buckets(
        stream: WeightStreamServer, published: dict[str, torch.Tensor]) -> None:
    tensors, buckets = pulled(StreamSource(stream.endpoint, "run", 3, TOKEN))
    assert tensors.keys() == published.keys()
    for name, tensor in published.items():
        assert torch.equal(tensors[name], tensor), name
    assert buckets == 3  # 6 x 24 KiB matrices in 64 KiB buckets: two per bucket


def test_floating_tensors_travel_in_the_servers_dtype_and_integers_as_they_are(
        stream: WeightStreamServer, published: dict[str, torch.Tensor]) -> None:
    tensors, _ = pulled(StreamSource(stream.endpoint, "run", 3, TOKEN), torch.bfloat16)
    assert tensors["layers.0.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["layers.0.weight"], published["layers.0.weight"].to(torch.bfloat16))
    assert tensors["positions"].dtype == torch.int64 and torch.equal(tensors["positions"], published["positions"])


def test_a_bucket_altered_in_flight_is_refused_naming_it(stream: WeightStreamServer) -> None:
    proxy = FlippingProxy(stream.endpoint, at=BUCKET + 2000)  # past the header and bucket 0: in bucket 1
    try:
        source = StreamSource(proxy.endpoint, "run", 3, TOKEN)
        handed_over = []
        with pytest.raises(BucketCorrupted, match=r"bucket 1 of 3 of version 3 of run run .*crc32 mismatch"):
            for bucket in pull(source):
                handed_over.append(bucket)
        assert len(handed_over) == 1  # bucket 0 only: nothing of the altered one
    finally:
        proxy.close()


def test_versions_not_offered_or_a_trainer_gone_are_said_plainly(stream: WeightStreamServer) -> None:
    assert offered(StreamSource(stream.endpoint, "run", 3, TOKEN)) is None
    assert "version 4 of run run is not offered" in (offered(StreamSource(stream.endpoint, "run", 4, TOKEN)) or "")
    with pytest.raises(StreamError, match="not offered"):
        pulled(StreamSource(stream.endpoint, "other", 3, TOKEN))
    endpoint = stream.endpoint
    stream.close()
    assert "unreachable" in (offered(StreamSource(endpoint, "run", 3, TOKEN)) or "")


def test_a_caller_without_the_token_gets_nothing(stream: WeightStreamServer) -> None:
    for token in (None, "a-guess"):
        source = StreamSource(stream.endpoint, "run", 3, token)
        assert "refused: the request does not carry the stream's token" in (offered(source) or "")
        with pytest.raises(StreamError, match="token"):
            pulled(source)


def test_a_deleted_file_ends_the_offer(stream: WeightStreamServer, tmp_path: Path) -> None:
    (tmp_path / WEIGHTS_FILE).unlink()  # what retention does to a deleted version's cache
    assert "not offered" in (offered(StreamSource(stream.endpoint, "run", 3, TOKEN)) or "")
