"""A real HTTPS file server on loopback for the dataset-address tests (``data add --url``):
a test CA and a certificate for 127.0.0.1 made with ``cryptography``, and a small HTTP/1.1
server on ``trio.serve_ssl_over_tcp`` that serves byte ranges the way a bucket does, or
misbehaves the way a test asks (wrong bytes, 404, Range ignored)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from urllib.parse import unquote, urlsplit

import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

PREFIX = "/data/"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_certs(folder: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key) as PEM files in ``folder``."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("ttpeer test CA")).issuer_name(_name("ttpeer test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


@dataclass
class FileServer:
    """Serves ``files`` (relative path -> bytes) at ``https://127.0.0.1:PORT/data/<path>``.

    ``mode``: "range" (206 for a Range, as S3 does), "ignore_range" (200 and the whole file,
    always), "wrong" (the right range of other bytes), "404" (nothing is there), "to_http"
    (a redirect to the same path over plain http).
    ``requests``: (path, range header, query) of each request, in order.
    """

    files: dict[str, bytes]
    mode: str = "range"
    url: str = ""
    requests: list[tuple[str, str | None, str]] = field(default_factory=list)

    async def start(self, nursery: trio.Nursery, folder: Path) -> ssl.SSLContext:
        """Serve in ``nursery``; returns a client context that trusts the server's CA."""
        ca, cert, key = make_certs(folder)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        listeners = await nursery.start(partial(trio.serve_ssl_over_tcp, self._handle, 0, context, host="127.0.0.1"))
        port = listeners[0].transport_listener.socket.getsockname()[1]
        self.url = f"https://127.0.0.1:{port}{PREFIX.rstrip('/')}"
        return ssl.create_default_context(cafile=str(ca))

    async def _handle(self, stream: trio.SSLStream) -> None:
        try:
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                head += chunk
            line, *fields = head.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
            target = urlsplit(line.split(" ")[1])
            rel = unquote(target.path[len(PREFIX):]) if target.path.startswith(PREFIX) else ""
            self.requests.append((rel, headers.get("range"), target.query))
            await stream.send_all(self._answer(rel, headers.get("range")))
            await stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def _answer(self, rel: str, ranged: str | None) -> bytes:
        data = self.files.get(rel)
        if self.mode == "to_http":
            return _response("302 Found", b"", f"location: {self.url.replace('https:', 'http:')}/{rel}")
        if data is None or self.mode == "404":
            return _response("404 Not Found", b"no such key\n")
        if self.mode == "wrong":
            data = bytes(b ^ 0x5A for b in data)
        if ranged is None or self.mode == "ignore_range":
            return _response("200 OK", data)
        first, _, last = ranged.removeprefix("bytes=").partition("-")
        a, b = int(first), min(int(last), len(data) - 1)
        return _response("206 Partial Content", data[a:b + 1], f"content-range: bytes {a}-{b}/{len(data)}")


def _response(status: str, body: bytes, *extra: str) -> bytes:
    head = [f"HTTP/1.1 {status}", f"content-length: {len(body)}", "connection: close", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body
