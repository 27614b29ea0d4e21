"""The sync's hot path: weights straight from the trainer into the servers, no file download.

The trainer serves every published version it still holds on its disk (the safetensors file it
just wrote, memory-mapped) over TCP. An inference server's weight-transfer engine
(inference/stream_engine.py, loaded into vLLM with `--weight-transfer-config`) pulls a version in
buckets and loads each into the model as it arrives; S3 stays the durable record, written beside
the next step, and the path for a server the trainer can no longer serve.

One pull is one TCP connection:

    client ─▶ {"run": ..., "version": v, "dtype": "bfloat16" | null, "header_only": false,
              "token": ...}\\n
    server ─▶ {"buckets": [[[name, dtype, shape], ...], ...]}\\n      (or {"error": "..."}\\n)
           ─▶ bucket 0's bytes, then its crc32 (4 bytes, big-endian), bucket 1's bytes, ...

The stream answers only callers with its token (the inference servers' admin token, which the
sidecar hands to the server's engine through vLLM's guarded update route), so weights served on a
reachable interface are not everyone's. Tensors travel in the dtype the server computes in
(converted bucket by bucket at the trainer), so a bf16 server moves half the bytes. A bucket whose
crc32 differs is refused before any of its tensors is loaded (BucketCorrupted); the sync then
rolls the server back (weights/sync.py).
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import socket
import socketserver
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from rlpipe.policy.checkpoint import WEIGHTS_FILE

log = logging.getLogger("rlpipe.stream")

BACKEND = "rlpipe_stream"
"""The name vLLM's weight-transfer factory knows the server's end by (inference/stream_engine.py)."""
DEFAULT_BUCKET_BYTES = 64 * 2**20
"""Bytes per bucket: large enough that per-bucket overheads vanish, small enough that a server
holds one bucket (not the model) beside its weights while loading."""
CONNECT_TIMEOUT_S = 5.0
READ_CHUNK = 4 * 2**20
ALIGN = 64
_CRC = struct.Struct(">I")

Tensors = list[tuple[str, torch.Tensor]]


class StreamError(RuntimeError):
    """The trainer's stream could not deliver the version (unreachable, or no longer offered)."""


class BucketCorrupted(StreamError):
    """A bucket's bytes differ from what the trainer sent (its crc32 does not match)."""


@dataclass(frozen=True)
class StreamSource:
    """Where a server pulls one version from: the trainer's endpoint ("host:port"), and the token
    the stream asks for."""

    endpoint: str
    run_id: str
    version: int
    token: str | None = field(default=None, repr=False)


# -- the trainer's side -------------------------------------------------------------------------------
class WeightStreamServer:
    """Serves the versions `offer`ed to it, each from its safetensors file on this machine, to any
    number of concurrent pulls (a thread per connection), to callers sending `token` (None: to
    anyone). Start with `start()`; `endpoint` is then the "host:port" to advertise (port 0 picks a
    free one)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.host = host
        self.bucket_bytes = bucket_bytes
        self._token = token
        self._offers: dict[tuple[str, int], Path] = {}
        self._lock = threading.Lock()
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                outer._serve(self.rfile, self.connection)

        self._server = socketserver.ThreadingTCPServer((host, port), Handler, bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """"host:port" as the servers should dial it: a wildcard bind advertises this host's name."""
        host, port = self._server.socket.getsockname()[:2]
        if host in ("0.0.0.0", "::"):
            host = socket.getfqdn()
        return f"{host}:{port}"

    def start(self) -> WeightStreamServer:
        self._server.server_bind()
        self._server.server_activate()
        self._thread = threading.Thread(target=self._server.serve_forever, name="weight-stream", daemon=True)
        self._thread.start()
        log.info("serving published weights at %s", self.endpoint)
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def offer(self, run_id: str, version: int, directory: Path) -> None:
        """Serve `version` of `run_id` from the checkpoint in `directory` (until it is withdrawn or
        its file disappears: retention deleting it ends the offer)."""
        with self._lock:
            self._offers[(run_id, version)] = Path(directory) / WEIGHTS_FILE

    def withdraw(self, run_id: str, version: int) -> None:
        with self._lock:
            self._offers.pop((run_id, version), None)

    def _serve(self, rfile: Any, connection: socket.socket) -> None:
        try:
            request = json.loads(rfile.readline(65536))
            run_id, version = str(request["run"]), int(request["version"])
            dtype = getattr(torch, request["dtype"]) if request.get("dtype") else None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            _send_line(connection, {"error": f"bad request: {exc}"})
            return
        if self._token is not None and not hmac.compare_digest(str(request.get("token")), self._token):
            _send_line(connection, {"error": "refused: the request does not carry the stream's token "
                                             "(the inference servers' admin token, RLPIPE_INFERENCE_TOKEN)"})
            return
        with self._lock:
            path = self._offers.get((run_id, version))
        if path is None or not path.exists():
            _send_line(connection, {"error": f"version {version} of run {run_id} is not offered here"})
            return
        try:
            self._send(connection, path, dtype, header_only=bool(request.get("header_only")))
        except OSError as exc:  # the server hung up: it refused a bucket, or it died
            log.info("a pull of %s v%d ended early: %s", run_id, version, exc)

    def _send(self, connection: socket.socket, path: Path, dtype: torch.dtype | None, *, header_only: bool) -> None:
        with safe_open(str(path), framework="pt") as weights:
            buckets = plan_buckets(weights, dtype, self.bucket_bytes)
            _send_line(connection, {"buckets": buckets})
            if header_only:
                return
            for bucket in buckets:
                crc = 0
                for (name, _, _), (offset, size), end in zip(bucket, *_layout(bucket), strict=True):
                    raw = _raw_bytes(weights.get_tensor(name), dtype)
                    padding = bytes(end - offset - size)
                    crc = zlib.crc32(padding, zlib.crc32(raw, crc))
                    connection.sendall(raw)
                    connection.sendall(padding)
                connection.sendall(_CRC.pack(crc))


def plan_buckets(weights: Any, dtype: torch.dtype | None, bucket_bytes: int) -> list[list[list[Any]]]:
    """The tensors of an open safetensors file grouped into buckets of about `bucket_bytes` (a
    tensor larger than that travels alone), each tensor as [name, wire dtype, shape]."""
    buckets: list[list[list[Any]]] = [[]]
    size = 0
    for name in weights.keys():
        piece = weights.get_slice(name)
        shape = list(piece.get_shape())
        stored = _SAFETENSORS_DTYPES[piece.get_dtype()]
        wire = _dtype_name(dtype) if dtype is not None and stored in _FLOATS else stored
        nbytes = _numel(shape) * _itemsize(wire)
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append([name, wire, shape])
        size += nbytes
    return [b for b in buckets if b]


def _layout(bucket: list[list[Any]]) -> tuple[list[tuple[int, int]], list[int]]:
    """Each tensor's (offset, size) in its bucket and where its padding ends: tensors start at
    ALIGN-byte boundaries, so the receiver views them in place without copying."""
    places, ends, offset = [], [], 0
    for _, wire, shape in bucket:
        size = _numel(shape) * _itemsize(wire)
        places.append((offset, size))
        offset += -(-size // ALIGN) * ALIGN
        ends.append(offset)
    return places, ends


def _raw_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> memoryview:
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor.contiguous().view(torch.uint8).numpy().data.cast("B")


# -- the server's side ---------------------------------------------------------------------------------
def pull(source: StreamSource, dtype: torch.dtype | None = None, timeout_s: float = 600.0) -> Iterator[Tensors]:
    """Yield the version's tensors a bucket at a time (in `dtype`, or as published), each bucket
    checked against its crc32 before it is yielded. Raises StreamError when the trainer does not
    serve the version and BucketCorrupted when a bucket arrives altered."""
    with _connect(source, dtype, timeout_s, header_only=False) as (stream, header):
        for index, bucket in enumerate(header):
            places, ends = _layout(bucket)
            data = _read_exactly(stream, ends[-1] + _CRC.size)
            body = memoryview(data)[: ends[-1]]
            (sent,) = _CRC.unpack(data[-_CRC.size:])
            if zlib.crc32(body) != sent:
                raise BucketCorrupted(f"bucket {index} of {len(header)} of version {source.version} of run "
                                      f"{source.run_id} from {source.endpoint} arrived altered (crc32 mismatch)")
            flat = torch.frombuffer(data, dtype=torch.uint8)
            yield [(name, flat[offset:offset + size].view(getattr(torch, wire)).reshape(shape))
                   for (name, wire, shape), (offset, size) in zip(bucket, places, strict=True)]


def offered(source: StreamSource, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when the trainer serves the version now, else why not (the sync then loads the durable
    copy instead)."""
    try:
        with _connect(source, None, timeout_s, header_only=True):
            return None
    except (StreamError, OSError) as exc:
        return str(exc)


class _connect:
    """A pull's connection and its header (the bucket plan)."""

    def __init__(self, source: StreamSource, dtype: torch.dtype | None, timeout_s: float, *, header_only: bool) -> None:
        self.source, self.timeout_s = source, timeout_s
        self.request = {"run": source.run_id, "version": source.version, "token": source.token,
                        "dtype": _dtype_name(dtype) if dtype is not None else None, "header_only": header_only}
        self.sock: socket.socket | None = None

    def __enter__(self) -> tuple[io.BufferedReader, list[list[list[Any]]]]:
        host, _, port = self.source.endpoint.rpartition(":")
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            raise StreamError(f"the trainer's weight stream at {self.source.endpoint} is unreachable: {exc}") from exc
        self.sock.settimeout(self.timeout_s)
        self.sock.sendall(json.dumps(self.request).encode() + b"\n")
        stream = self.sock.makefile("rb")
        answer = json.loads(stream.readline() or b'{"error": "the connection closed before the header"}')
        if "error" in answer:
            raise StreamError(f"{self.source.endpoint}: {answer['error']}")
        return stream, answer["buckets"]

    def __exit__(self, *exc_info: object) -> None:
        if self.sock is not None:
            self.sock.close()


def _read_exactly(stream: io.BufferedReader, size: int) -> bytearray:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = stream.readinto(view[got:got + READ_CHUNK])
        if not n:
            raise StreamError(f"the trainer's stream ended after {got} of {size} bytes of a bucket")
        got += n
    return data


def _send_line(connection: socket.socket, message: dict[str, Any]) -> None:
    connection.sendall(json.dumps(message).encode() + b"\n")


_FLOATS = {"float32", "bfloat16", "float16"}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64", "I32": "int32",
                       "U8": "uint8", "BOOL": "bool"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsize(name: str) -> int:
    return torch.empty((), dtype=getattr(torch, name)).element_size()


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
