"""TLS for the test kit's PostgreSQL server, as production runs it.

:func:`make_tls` makes, per server, a test certificate authority and a server
certificate it signs (for ``127.0.0.1``, ``::1`` and ``localhost``; ECDSA
P-256, a week long) with the ``cryptography`` package, in a directory the
server reads; :meth:`ServerTls.settings` turns ``ssl`` on with them. Clients
that trust :attr:`ServerTls.cafile` connect with ``sslmode=verify-full``
(:meth:`ServerTls.client_params`); clients that do not ask for TLS keep
working (libpq's default ``sslmode=prefer`` takes TLS when the server offers
it; the kit's plain DSNs say ``sslmode=disable``, which saves the handshake).

The server's ``pg_hba.conf`` (:func:`hba`) lets every role in as before
(``trust`` on loopback) except the members of :data:`HOSTSSL_GROUP`: those
must come over TLS (``hostssl``) with their password (``scram-sha-256``), and
are refused without TLS. :func:`create_role` makes such a role: what a
production database's application role is, for the tests of least grants.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HOSTSSL_GROUP = "twophase_hostssl"
"""the group role whose members may connect only over TLS, with a password"""


@dataclass(frozen=True)
class ServerTls:
    """The files of one server's TLS: the CA's certificate, the server's
    certificate and its key."""

    directory: Path

    @property
    def cafile(self) -> str:
        """The test CA's certificate (PEM): what clients trust (``sslrootcert``)."""
        return str(self.directory / "ca.crt")

    @property
    def certfile(self) -> str:
        """The server's certificate (PEM), signed by the CA."""
        return str(self.directory / "server.crt")

    @property
    def keyfile(self) -> str:
        """The server's private key (PEM, mode 0600, owned by the server's user)."""
        return str(self.directory / "server.key")

    def settings(self) -> dict[str, str]:
        """The server settings that turn TLS on with these files."""
        return {"ssl": "on", "ssl_cert_file": self.certfile, "ssl_key_file": self.keyfile}

    def client_params(self) -> dict[str, str]:
        """libpq parameters of a client that checks the server's certificate
        and name (``sslmode=verify-full``)."""
        return {"sslmode": "verify-full", "sslrootcert": self.cafile}


def make_tls(directory: Path, chown: Callable[[Path], None] = lambda _: None) -> ServerTls:
    """Make the CA, the server certificate and its key in ``directory``
    (created); ``chown`` hands each file to the server's user."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=7))

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("twophase test CA"))
        .issuer_name(name("twophase test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names = x509.SubjectAlternativeName(
        [
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
            x509.DNSName("localhost"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(alt_names, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    tls = ServerTls(directory)
    pem = serialization.Encoding.PEM
    Path(tls.cafile).write_bytes(ca.public_bytes(pem))
    Path(tls.certfile).write_bytes(cert.public_bytes(pem))
    secret = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(tls.keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:  # the server refuses a key others may read
        f.write(secret)
    for p in (directory, Path(tls.certfile), Path(tls.keyfile), Path(tls.cafile)):
        chown(p)
    return tls


def hba(tls: bool) -> str:
    """The server's ``pg_hba.conf``: ``trust`` on loopback, as ``initdb
    --auth=trust`` writes it, and with ``tls`` the members of
    :data:`HOSTSSL_GROUP` only over TLS, with their password."""
    lines = ["local all all trust"]
    if tls:
        for net in ("127.0.0.1/32", "::1/128"):
            lines.append(f"hostssl all +{HOSTSSL_GROUP} {net} scram-sha-256")
            lines.append(f"host all +{HOSTSSL_GROUP} {net} reject")
    for net in ("127.0.0.1/32", "::1/128"):
        lines.append(f"host all all {net} trust")
    lines += ["local replication all trust", "host replication all 127.0.0.1/32 trust"]
    return "\n".join(lines) + "\n"


def create_role(admin_dsn: str, role: str, password: str) -> None:
    """Create the LOGIN role ``role`` in :data:`HOSTSSL_GROUP` (it may connect
    only over TLS, with ``password``), with no privilege of its own. The
    password goes to the server as its SCRAM verifier, never in clear."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            "DO $$ BEGIN CREATE ROLE " + HOSTSSL_GROUP + " NOLOGIN; "
            "EXCEPTION WHEN duplicate_object THEN NULL; END $$"
        )
        verifier = conn.pgconn.encrypt_password(
            password.encode(), role.encode(), b"scram-sha-256"
        ).decode()
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                sql.Identifier(role), sql.Literal(verifier), sql.Identifier(HOSTSSL_GROUP)
            )
        )
