"""The object store against the real SeaweedFS S3 gateway."""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from pathlib import Path

import pytest
from boto3.s3.transfer import TransferConfig

import rlpipe.storage.object_store as object_store_module
from rlpipe.storage.digest import sha256_file
from rlpipe.storage.object_store import DigestMismatch, ObjectStore, ObjectStoreError

pytestmark = pytest.mark.stack


def random_file(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        remaining = size
        while remaining:
            block = os.urandom(min(remaining, 4 * 1024 * 1024))
            digest.update(block)
            f.write(block)
            remaining -= len(block)
    return digest.hexdigest()


def test_large_object_round_trip_verifies_sha256(object_store: ObjectStore, tmp_path: Path) -> None:
    size = 64 * 1024 * 1024 + 12345  # > 64 MiB: a multipart upload (and download) of 5 parts
    source = tmp_path / "big.bin"
    digest = random_file(source, size)
    key = f"test/{uuid.uuid4()}/big.bin"

    info = object_store.put_file(key, source)
    assert (info.size, info.sha256) == (size, digest)
    assert object_store.head(key).sha256 == digest  # recorded in the object's metadata

    target = tmp_path / "back.bin"
    got = object_store.get_file(key, target, expected_sha256=digest)
    assert got.sha256 == digest and sha256_file(target) == digest and target.stat().st_size == size
    object_store.delete(key)
    assert not object_store.exists(key)


def test_a_download_in_many_ranges_is_hashed_in_order_whatever_the_environment(
        endpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """get_file hashes the ranges as boto3 writes them; with more ranges than s3transfer buffers
    (10), and response checksums switched off by the environment, which deadlocked it once."""
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    monkeypatch.setattr(object_store_module, "TRANSFER",
                        TransferConfig(multipart_chunksize=1024 * 1024, multipart_threshold=1024 * 1024))
    store = ObjectStore.from_endpoints(endpoints)
    data = os.urandom(12 * 1024 * 1024 + 7)  # 13 ranges of 1 MiB
    key = f"test/{uuid.uuid4()}/ranges.bin"
    store.put_bytes(key, data)
    result: list[str | None] = []
    worker = threading.Thread(target=lambda: result.append(store.get_file(key, tmp_path / "r.bin").sha256),
                              daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the download hung"
    assert result == [hashlib.sha256(data).hexdigest()] and (tmp_path / "r.bin").read_bytes() == data
    store.delete(key)


def test_wrong_digest_is_refused_and_leaves_no_file(object_store: ObjectStore, tmp_path: Path) -> None:
    key = f"test/{uuid.uuid4()}/small.bin"
    object_store.put_bytes(key, b"weights")
    with pytest.raises(DigestMismatch, match=key):
        object_store.get_file(key, tmp_path / "x.bin", expected_sha256="0" * 64)
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.bin.partial").exists()


def test_content_addressed_layout_names_the_digest(object_store: ObjectStore, tmp_path: Path) -> None:
    prefix = f"test/{uuid.uuid4()}/checkpoints"
    path = tmp_path / "model.safetensors"
    digest = random_file(path, 1000)
    first = object_store.put_content_addressed(prefix, path)
    assert first.key == f"{prefix}/sha256-{digest}/model.safetensors"
    again = object_store.put_content_addressed(prefix, path)  # identical content: same key, no new object
    assert again.key == first.key
    assert [info.key for info in object_store.list(prefix)] == [first.key]
    assert object_store.get_bytes(first.key) == path.read_bytes()
    assert object_store.delete_prefix(prefix) == 1


def test_missing_object_error_names_the_key(object_store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectStoreError, match="test/missing-object"):
        object_store.get_file("test/missing-object", tmp_path / "y")
    assert not object_store.exists("test/missing-object")


def test_bad_credentials_are_refused(endpoints) -> None:  # type: ignore[no-untyped-def]
    store = ObjectStore.connect(endpoints.s3_endpoint, "nobody", "wrong-secret", endpoints.bucket, retries=1)
    with pytest.raises(ObjectStoreError, match=endpoints.bucket):
        store.check()
