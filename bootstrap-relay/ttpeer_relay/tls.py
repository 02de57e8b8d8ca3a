"""The relay's TLS certificate: generated once, then reused, and its fingerprint.

Peers pin the certificate by fingerprint (``sha256:`` + hex sha256 of the DER),
which travels in invite tokens; that is why a self-signed certificate is safe
here, and why it must survive restarts. Regenerating it (deleting ``tls/``)
invalidates every token that names this relay.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from ttpeer_wire import fingerprint

VALIDITY = datetime.timedelta(days=3650)


def pem_fingerprint(cert_path: Path) -> str:
    """Fingerprint of the first (leaf) certificate in a PEM file."""
    return fingerprint(ssl.PEM_cert_to_DER_cert(cert_path.read_text()))


def _san_names(host: str) -> list[x509.GeneralName]:
    names: dict[str, x509.GeneralName] = {}
    candidates = [host, "127.0.0.1", "::1", "localhost"]
    try:
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        unspecified = False
    if unspecified:  # listening on every address: name this machine as well
        candidates.append(socket.gethostname())
    for name in candidates:
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            if name and all(part.isascii() for part in name):
                names[name.lower()] = x509.DNSName(name.lower())
            continue
        if not ip.is_unspecified:
            names[str(ip)] = x509.IPAddress(ip)
    return list(names.values())


def ensure_certificate(tls_dir: Path, host: str) -> tuple[Path, Path]:
    """Return (cert.pem, key.pem) in ``tls_dir``, generating them on first use.

    Raises ``OSError`` if the directory cannot be created or written.
    """
    cert_path, key_path = tls_dir / "cert.pem", tls_dir / "key.pem"
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path
    tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(tls_dir, 0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ttpeer-relay")])
    now = datetime.datetime.now(datetime.UTC)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName(_san_names(host)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write(key_path, key_pem, 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write atomically, created with ``mode`` from the start (no window of wider access)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
