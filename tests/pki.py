"""Certificates for TLS tests, made by `trustme`: one CA the stack trusts, a certificate for the
services (localhost, 127.0.0.1), one for a client, and a certificate of another CA."""

from __future__ import annotations

from pathlib import Path

import trustme


def write_pair(cert: trustme.LeafCert, directory: Path, name: str) -> tuple[str, str]:
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    for blob in cert.cert_chain_pems[1:]:
        blob.write_to_path(str(cert_path), append=True)
    cert.private_key_pem.write_to_path(str(key_path))
    return str(cert_path), str(key_path)


def make_pki(d: Path) -> dict:
    """Paths: "ca", "stranger_ca" (PEM); "service", "client", "stranger" ((cert, key)); the
    stranger's certificate is for localhost/127.0.0.1 too, signed by the other CA."""
    ca, stranger = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    stranger.cert_pem.write_to_path(str(d / "stranger-ca.pem"))
    return {
        "ca": str(d / "ca.pem"),
        "stranger_ca": str(d / "stranger-ca.pem"),
        "service": write_pair(ca.issue_cert("localhost", "127.0.0.1"), d, "service"),
        "client": write_pair(ca.issue_cert("client.epd.test"), d, "client"),
        "stranger": write_pair(stranger.issue_cert("localhost", "127.0.0.1"), d, "stranger"),
    }
