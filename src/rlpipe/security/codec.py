"""Encryption of Temporal payloads (AES-256-GCM) with a key that only workers and operators hold.

Temporal stores every workflow input, activity result and signal in its history. rlpipe keeps
secrets out of payloads anyway (addresses and credentials come from each worker's environment),
but run configs, prompts and metrics are still the user's data: with `RLPIPE_PAYLOAD_KEY` set
(32 random bytes, base64), every payload is encrypted before it leaves the process, and the
Temporal server, its database and its UI see only ciphertext. The codec server (`rlpipe codec`)
lets the Web UI show decoded payloads to whoever can reach it with the key.

    export RLPIPE_PAYLOAD_KEY=$(python -c "import os, base64; print(base64.b64encode(os.urandom(32)).decode())")
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Sequence

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

ENCODING = b"binary/encrypted"
KEY_ENV = "RLPIPE_PAYLOAD_KEY"
NONCE_BYTES = 12


class PayloadKeyError(ValueError):
    """The payload key is malformed, or a payload was encrypted with another key."""


class EncryptionCodec(PayloadCodec):
    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise PayloadKeyError(f"{KEY_ENV} must decode to 32 bytes (AES-256), got {len(key)}")
        self._aead = AESGCM(key)
        self.key_id = hashlib.sha256(key).hexdigest()[:16].encode()  # names the key, reveals nothing

    @classmethod
    def from_environment(cls) -> EncryptionCodec | None:
        """The codec for `RLPIPE_PAYLOAD_KEY`, or None when encryption is off."""
        value = os.environ.get(KEY_ENV)
        if not value:
            return None
        try:
            key = base64.b64decode(value, validate=True)
        except ValueError as exc:
            raise PayloadKeyError(f"{KEY_ENV} is not valid base64") from exc
        return cls(key)

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [Payload(metadata={"encoding": ENCODING, "encryption-key-id": self.key_id},
                        data=self._encrypt(p.SerializeToString())) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        decoded = []
        for p in payloads:
            if p.metadata.get("encoding") != ENCODING:
                decoded.append(p)  # written before encryption was turned on
                continue
            if p.metadata.get("encryption-key-id") != self.key_id:
                raise PayloadKeyError(f"payload encrypted with key {p.metadata.get('encryption-key-id')!r}, "
                                      f"this process holds {self.key_id!r}")
            decoded.append(Payload.FromString(self._decrypt(p.data)))
        return decoded

    def _encrypt(self, data: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, data, None)

    def _decrypt(self, data: bytes) -> bytes:
        return self._aead.decrypt(data[:NONCE_BYTES], data[NONCE_BYTES:], None)
