"""Self-signed certificates for the deployment tests, made with `openssl` as an operator would: a
certificate authority of the test's own, and a server certificate it signs for 127.0.0.1 and
localhost (the names the tests connect to, so clients can verify them in full)."""

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.tools import tool


@dataclass(frozen=True)
class Certificates:
    ca: Path  # the authority's certificate: what clients trust
    cert: Path  # the server's certificate, signed by the authority
    key: Path  # its private key


def certificates_make(directory: Path, *, name: str = "server") -> Certificates:
    """A new authority and a server certificate for 127.0.0.1 and localhost, valid for a day."""
    openssl = tool("openssl", package="openssl")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, request = directory / f"{name}.pem", directory / f"{name}.key", directory / f"{name}.csr"
    extensions = directory / f"{name}.ext"
    extensions.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
    )

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=Telemachus test CA",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
    )
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(request))
    run(
        "x509",
        "-req",
        "-in",
        str(request),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        str(extensions),
        "-out",
        str(cert),
    )
    return Certificates(ca=ca, cert=cert, key=key)
