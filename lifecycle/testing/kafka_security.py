"""A secured test broker: SASL_SSL with SCRAM-SHA-512, ACLs enforced.

:class:`SecureListener` is what :class:`~lifecycle.testing.apache_kafka.ApacheKafka`
needs to serve its clients over SASL_SSL instead of PLAINTEXT:

* a TLS key pair made with the JDK's ``keytool`` (Java runs the broker, so
  nothing else is needed): a self-signed certificate for ``127.0.0.1`` and
  ``localhost`` in a PKCS12 keystore, and the certificate as PEM, which the
  clients trust (``ssl_cafile``);
* SCRAM-SHA-512 users, written into the log directory when it is formatted
  (``StorageTool format --add-scram``): ``admin``, the super user the broker
  itself and the tests' setup use, and the ``users`` given;
* the StandardAuthorizer (KRaft's), with ``admin`` and ``ANONYMOUS`` as super
  users: the broker's own requests to its controller come over the
  controller listener, which stays PLAINTEXT on loopback and takes no client.
  Every other principal may do only what an ACL allows.

:meth:`SecureListener.client` gives a user's kafka-python settings (what a
``KafkaSink`` takes as ``producer_config``), :meth:`SecureListener.librdkafka`
and :meth:`SecureListener.spark` the same for confluent-kafka and Spark's Kafka
source.
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MECHANISM = "SCRAM-SHA-512"
ADMIN = "admin"


class KafkaSecurityError(RuntimeError):
    """The keystore could not be made."""


@dataclass
class SecureListener:
    """SASL_SSL (SCRAM-SHA-512) for one test broker (module docstring).

    ``users`` are the extra SCRAM users, ``{name: password}``; passwords are
    random unless given."""

    users: dict[str, str] = field(default_factory=dict)
    admin_password: str = field(default_factory=lambda: secrets.token_hex(12))
    _dir: Path | None = None
    _store_password: str = field(default_factory=lambda: secrets.token_hex(12))

    def prepare(self, workdir: Path, keytool: str) -> None:
        """Make the keystore and the CA file in ``workdir`` (once)."""
        if self._dir is not None:
            return
        workdir.mkdir(parents=True, exist_ok=True)
        store, pem = workdir / "broker.p12", workdir / "broker-cert.pem"
        common = ["-keystore", str(store), "-storetype", "PKCS12"]
        common += ["-storepass", self._store_password]
        for cmd in (
            [
                keytool,
                "-genkeypair",
                "-alias",
                "broker",
                "-keyalg",
                "RSA",
                "-keysize",
                "2048",
                "-validity",
                "7",
                "-dname",
                "CN=127.0.0.1",
                "-ext",
                "SAN=ip:127.0.0.1,dns:localhost",
                *common,
            ],
            [keytool, "-exportcert", "-rfc", "-alias", "broker", "-file", str(pem), *common],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise KafkaSecurityError(
                    f"keytool failed ({cmd[1]}): {(done.stdout + done.stderr)[-2000:]}"
                )
        self._dir = workdir

    @property
    def cafile(self) -> str:
        """The PEM file of the broker's certificate, which clients trust."""
        assert self._dir is not None, "prepare() first"
        return str(self._dir / "broker-cert.pem")

    def password(self, user: str) -> str:
        """The SCRAM password of ``user`` (the admin's or a user's added earlier)."""
        return self.admin_password if user == ADMIN else self.users[user]

    def _jaas(self, user: str) -> str:
        """The JAAS line of ``user``'s SCRAM login (the broker's own, Java clients')."""
        return (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{user}" password="{self.password(user)}";'
        )

    def scram_arguments(self) -> list[str]:
        """``StorageTool format`` arguments that create the SCRAM users."""
        out: list[str] = []
        for user in [ADMIN, *self.users]:
            out += ["--add-scram", f"{MECHANISM}=[name={user},password={self.password(user)}]"]
        return out

    def broker_config(self, port: int, controller_port: int) -> dict[str, str]:
        """The broker's listener, TLS, SASL and authorizer settings."""
        assert self._dir is not None, "prepare() first"
        return {
            "listeners": (f"SASL_SSL://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}"),
            "advertised.listeners": f"SASL_SSL://127.0.0.1:{port}",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": MECHANISM,
            "sasl.mechanism.inter.broker.protocol": MECHANISM,
            f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config": self._jaas(ADMIN),
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(self._dir / "broker.p12"),
            "ssl.keystore.password": self._store_password,
            "ssl.key.password": self._store_password,
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": self.cafile,
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{ADMIN};User:ANONYMOUS",
            "allow.everyone.if.no.acl.found": "false",
        }

    def client(self, user: str) -> dict[str, Any]:
        """kafka-python settings for ``user`` (a ``KafkaSink``'s ``producer_config``)."""
        return {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": MECHANISM,
            "sasl_plain_username": user,
            "sasl_plain_password": self.password(user),
            "ssl_cafile": self.cafile,
        }

    def librdkafka(self, user: str) -> dict[str, str]:
        """confluent-kafka (librdkafka) settings for ``user``."""
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": MECHANISM,
            "sasl.username": user,
            "sasl.password": self.password(user),
            "ssl.ca.location": self.cafile,
        }

    def spark(self, user: str) -> dict[str, str]:
        """Spark Kafka source options (``kafka.``-prefixed) for ``user``."""
        return {
            "kafka.security.protocol": "SASL_SSL",
            "kafka.sasl.mechanism": MECHANISM,
            "kafka.sasl.jaas.config": self._jaas(user),
            "kafka.ssl.truststore.type": "PEM",
            "kafka.ssl.truststore.location": self.cafile,
        }
