"""A TCP proxy that alters one byte of what the upstream sends: a transfer corrupted in flight."""

from __future__ import annotations

import socket
import threading


class FlippingProxy:
    """Forwards TCP connections to `upstream` ("host:port"), flipping the byte at offset `at` of
    what the upstream sends on each: a bucket altered in flight."""

    def __init__(self, upstream: str, at: int) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream, self.at = (host, int(port)), at
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(downstream, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, downstream, self.at), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, flip_at: int | None) -> None:
        seen = 0
        with source, sink:
            try:
                while chunk := source.recv(65536):
                    data = bytearray(chunk)
                    if flip_at is not None and seen <= flip_at < seen + len(data):
                        data[flip_at - seen] ^= 0xFF
                    seen += len(data)
                    sink.sendall(data)
            except OSError:  # the other end hung up (the receiver refuses the altered bucket)
                return

    def close(self) -> None:
        self.listener.close()
