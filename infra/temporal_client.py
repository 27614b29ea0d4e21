"""How every rlpipe process connects to Temporal: the workers, the CLI and the stack's own checks.

Client settings load the way Temporal's own tools load them (`temporalio.envconfig`, the same code
as the `temporal` CLI and the other SDKs): a profile (`TEMPORAL_PROFILE`, default "default") of the
config file (`TEMPORAL_CONFIG_FILE`, default `~/.config/temporalio/temporal.toml`, the file that
`temporal config set` writes), with the environment on top:

| variable | meaning |
|---|---|
| `TEMPORAL_ADDRESS`, `TEMPORAL_NAMESPACE` | the frontend (host:port) and namespace |
| `TEMPORAL_API_KEY` | an API key (Temporal Cloud); turns TLS on with the system's root certificates |
| `TEMPORAL_TLS` | `true` for TLS with the system's roots and no client certificate |
| `TEMPORAL_TLS_SERVER_CA_CERT_PATH` / `_DATA` | the CA that signed the server's certificate |
| `TEMPORAL_TLS_SERVER_NAME` | the name the server's certificate carries, when not the address's host |
| `TEMPORAL_TLS_CLIENT_CERT_PATH` / `_DATA`, `TEMPORAL_TLS_CLIENT_KEY_PATH` / `_DATA` | mTLS: our certificate and key |

The profile's address and namespace become the stack's (`settings.load_settings`: an address means
an external cluster, so the local dev server is not started). Its API key, TLS and gRPC metadata
apply to that external cluster only: the local dev server speaks plain gRPC.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from temporalio.client import Client
from temporalio.converter import DataConverter
from temporalio.envconfig import ClientConfigProfile
from temporalio.runtime import Runtime
from temporalio.service import TLSConfig

PROFILE_ENV = "TEMPORAL_PROFILE"


class TemporalSettingsError(ValueError):
    """The Temporal client settings (config file, profile or TEMPORAL_* variables) are unusable."""


class TemporalUnreachable(RuntimeError):
    """No client could be connected; the message says where to, how, and the SDK's reason.
    A RuntimeError like the SDK's own connect failure, so callers that wait for an outage keep working."""


def load_profile(env: Mapping[str, str] | None = None) -> ClientConfigProfile:
    """The Temporal client profile of `env` (default: this process's environment)."""
    env = dict(os.environ if env is None else env)
    try:
        return ClientConfigProfile.load(profile=env.get(PROFILE_ENV), override_env_vars=env)
    except Exception as exc:  # noqa: BLE001 - the bridge's ConfigError, a TOML error, an unreadable file
        raise TemporalSettingsError(f"Temporal client settings ({_where(env)}): {exc}") from exc


@dataclass(frozen=True)
class TemporalConnection:
    """Where and how to connect: everything `Client.connect` takes besides the data converter and runtime."""

    address: str
    namespace: str
    api_key: str | None = field(default=None, repr=False)
    tls: bool | TLSConfig = field(default=False, repr=False)
    rpc_metadata: Mapping[str, str] = field(default_factory=dict, repr=False)

    def describe(self) -> str:
        """How the connection is secured, for error messages (never the secrets themselves)."""
        if self.tls is False:
            how = "plain gRPC, no TLS"
        elif isinstance(self.tls, TLSConfig) and self.tls.client_cert:
            how = "mTLS with a client certificate"
        else:
            how = "TLS without a client certificate"
        return how + (" + API key" if self.api_key else "")


def temporal_connection(address: str, namespace: str, *, external: bool,
                        env: Mapping[str, str] | None = None) -> TemporalConnection:
    """The connection to `address`: with the profile's API key and TLS when it is an external cluster,
    plain for the local dev server."""
    if not external:
        return TemporalConnection(address, namespace)
    profile = load_profile(env)
    tls = profile.tls
    if tls is not None and bool(tls.client_cert) != bool(tls.client_private_key):
        raise TemporalSettingsError("mTLS needs both a client certificate and its key: set "
                                    "TEMPORAL_TLS_CLIENT_CERT_PATH and TEMPORAL_TLS_CLIENT_KEY_PATH (or the "
                                    "profile's tls.client_cert and tls.client_key)")
    try:
        config = profile.to_client_connect_config()  # reads the certificate files
    except OSError as exc:
        raise TemporalSettingsError(f"Temporal TLS settings: cannot read {exc.filename}: {exc.strerror}") from exc
    return TemporalConnection(address, namespace, api_key=config.get("api_key"), tls=config.get("tls", False),
                              rpc_metadata=config.get("rpc_metadata", {}))


async def connect_temporal(conn: TemporalConnection, *, data_converter: DataConverter = DataConverter.default,
                           runtime: Runtime | None = None) -> Client:
    """A client of `conn`: the one place rlpipe calls `Client.connect`."""
    try:
        return await Client.connect(conn.address, namespace=conn.namespace, api_key=conn.api_key, tls=conn.tls,
                                    rpc_metadata=conn.rpc_metadata, data_converter=data_converter, runtime=runtime)
    except RuntimeError as exc:  # the SDK's "Failed client connect: ..." (refused, TLS handshake, bad key)
        raise TemporalUnreachable(f"cannot reach Temporal at {conn.address} (namespace {conn.namespace}, "
                                  f"{conn.describe()}): {exc}{_likely_cause(conn, str(exc))}") from exc


def _likely_cause(conn: TemporalConnection, error: str) -> str:
    """What to check, in words: the SDK reports a refused TLS handshake as a bare transport error."""
    if conn.tls is False:
        return ""
    if "InvalidCertificate" in error:
        return (". The server's certificate is not one this client trusts: set TEMPORAL_TLS_SERVER_CA_CERT_PATH to the "
                "CA that signed it (and TEMPORAL_TLS_SERVER_NAME to the name it carries)")
    if isinstance(conn.tls, TLSConfig) and conn.tls.client_cert:
        return (". A server that does not trust this client certificate (TEMPORAL_TLS_CLIENT_CERT_PATH) ends the "
                "connection so: use one signed by a CA the server accepts")
    if conn.api_key:
        return ". Check TEMPORAL_API_KEY, and that the address is the namespace's own endpoint"
    return (". A server that requires client certificates (mTLS) ends the connection so: set "
            "TEMPORAL_TLS_CLIENT_CERT_PATH and TEMPORAL_TLS_CLIENT_KEY_PATH")


def _where(env: Mapping[str, str]) -> str:
    profile = env.get(PROFILE_ENV, "default")
    return f"profile '{profile}' of {env.get('TEMPORAL_CONFIG_FILE', '~/.config/temporalio/temporal.toml')}"
