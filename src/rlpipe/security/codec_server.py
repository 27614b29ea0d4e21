"""`rlpipe codec`: the Temporal codec-server protocol (POST /encode, POST /decode) over the
payload key, so the Web UI (started with `--ui-codec-endpoint`) can show decoded payloads to
whoever reaches this server. It binds to loopback by default; put real authentication in front
of it before exposing it anywhere else."""

from __future__ import annotations

import asyncio
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from rlpipe.security.codec import EncryptionCodec


def make_handler(codec: EncryptionCodec, allowed_origin: str) -> type[BaseHTTPRequestHandler]:
    class CodecHandler(BaseHTTPRequestHandler):
        def _cors(self) -> None:
            self.send_header("Access-Control-Allow-Origin", allowed_origin)
            self.send_header("Access-Control-Allow-Methods", "POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "content-type, x-namespace, authorization")

        def do_OPTIONS(self) -> None:  # noqa: N802 - the stdlib names it
            self.send_response(200)
            self._cors()
            self.end_headers()

        def do_POST(self) -> None:  # noqa: N802
            if self.path not in ("/encode", "/decode"):
                self.send_error(404, f"no codec route {self.path}: use /encode or /decode")
                return
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            payloads = json_format.Parse(body, Payloads())
            convert = codec.encode if self.path == "/encode" else codec.decode
            try:
                result = Payloads(payloads=asyncio.run(convert(list(payloads.payloads))))
            except Exception as exc:  # noqa: BLE001 - a wrong key or a corrupt payload: say so
                self.send_error(400, str(exc))
                return
            out = json.dumps(json_format.MessageToDict(result)).encode()
            self.send_response(200)
            self._cors()
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, format: str, *args: object) -> None:  # quiet
            return

    return CodecHandler


def serve(codec: EncryptionCodec, host: str, port: int, allowed_origin: str) -> ThreadingHTTPServer:
    return ThreadingHTTPServer((host, port), make_handler(codec, allowed_origin))
