"""A TLS-terminating TCP proxy in front of the Temporal dev server (which has no TLS flags), and the
certificates for it: a CA, a server certificate for 127.0.0.1, and client certificates for mTLS."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

PROXY_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


class Authority:
    """A certificate authority of the test's own, writing PEM files under `directory`."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
        self.certificate = (_builder(subject, subject, self.key.public_key())
                            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                            .add_extension(_key_usage(cert_sign=True), critical=True)
                            .sign(self.key, hashes.SHA256()))
        self.cert = directory / f"{name}-ca.pem"
        self.cert.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))

    def issue(self, common_name: str, *, server: bool) -> Issued:
        """A leaf certificate: for the server (valid for 127.0.0.1 and localhost) or a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (_builder(subject, self.certificate.subject, key.public_key())
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(_key_usage(cert_sign=False), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(PROXY_HOST)), x509.DNSName("localhost")]), critical=False)
        certificate = builder.sign(self.key, hashes.SHA256())
        stem = self.directory / f"{self.name}-{common_name}"
        issued = Issued(stem.with_suffix(".pem"), stem.with_suffix(".key"))
        issued.cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
        return issued


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
                         encipher_only=False, decipher_only=False)


def server_context(server: Issued, client_ca: Path | None) -> ssl.SSLContext:
    """TLS as a gRPC server speaks it (ALPN h2); with `client_ca`, only clients it signed get in (mTLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(server.cert, server.key)
    context.set_alpn_protocols(["h2"])
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca)
    return context


@contextlib.asynccontextmanager
async def tls_proxy(upstream: str, context: ssl.SSLContext) -> AsyncIterator[str]:
    """Serve TLS on a free loopback port and forward the plain bytes to `upstream` (host:port);
    yields the proxy's address. Its connections end with it."""
    host, port = upstream.rsplit(":", 1)
    connections: set[asyncio.Task[None]] = set()
    writers: set[asyncio.StreamWriter] = set()

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass  # the other side went away, or a refused client's handshake ended
        finally:
            writer.close()

    async def connect(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        connections.add(task)
        writers.add(client_writer)
        try:
            server_reader, server_writer = await asyncio.open_connection(host, int(port))
            writers.add(server_writer)
            await asyncio.gather(forward(client_reader, server_writer), forward(server_reader, client_writer))
        finally:
            connections.discard(task)

    server = await asyncio.start_server(connect, PROXY_HOST, 0, ssl=context)
    try:
        yield f"{PROXY_HOST}:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for writer in writers:  # ends each connection's reads; cancelling its task would log an error
            writer.transport.abort()
        await asyncio.gather(*connections, return_exceptions=True)
        await server.wait_closed()
