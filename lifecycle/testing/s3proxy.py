"""An S3 server for tests, demos and the kit: S3Proxy on loopback.

``S3Proxy`` runs `S3Proxy <https://github.com/gaul/s3proxy>`_ (the S3 API in
front of jclouds' and its own blob stores) from the jars that
:mod:`lifecycle.testing.jars` fetched (set ``s3proxy``), with Java:
``org.gaul.s3proxy.Main --properties`` on a free port of 127.0.0.1,
path-style (``s3proxy.virtual-host`` unset), signed requests only
(``s3proxy.authorization=aws-v2-or-v4``, with an access key and a secret of
its own, random per server), the objects as files under a temporary directory
(``jclouds.provider=filesystem-nio2``, ``jclouds.filesystem.basedir``). Unlike
moto's server (``tests/s3server.py``) it is a separate process that keeps its
objects on disk, reached by deltalake, boto3 and Hadoop's S3A over HTTP as
they reach a store in production.

It does not honour everything S3 does: ``tests/test_s3_store.py`` measures
what it does and ``docs/testing.md`` tables it. In short: a conditional PUT
(``If-None-Match: *``, ``If-Match``) is refused with 412 when it should be,
but checked before the write, so writers racing on one key may all succeed;
and its file stores break S3A's directory markers (an empty ``d/`` object),
which Spark's checkpoints on ``s3a://`` need: ``provider="transient"`` (in
memory) keeps them.

:meth:`S3Proxy.storage_options` gives deltalake's settings for it
(``DeltaSink(..., storage_options=...)``), :meth:`S3Proxy.spark_conf` a Spark
session's for S3A (:func:`s3a_conf`; the session also needs the ``s3a`` jars).
``stop()`` then ``start()`` brings it back on the same port and directory
(the ``transient`` store forgets its objects); ``cleanup()`` deletes them.
Run as a program (``python -m lifecycle.testing.s3proxy --bucket NAME``) it
starts one, creates the buckets, prints its endpoint and keys, and waits for
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from lifecycle.testing import jars
from lifecycle.testing.services import ProcessService, free_port, java, serve

S3ProxyJarsMissing = jars.JarsMissingError

MAIN = "org.gaul.s3proxy.Main"
REGION = "us-east-1"
"""the region clients sign for (S3Proxy accepts any; boto3 and S3A need one)"""


_LOGBACK = """<configuration>
  <appender name="out" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>%d{HH:mm:ss.SSS} %-5level %logger{20} - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="out"/></root>
</configuration>
"""


class S3ProxyError(RuntimeError):
    """S3Proxy did not start, or died; carries the tail of its log."""


def _java() -> str:
    return java("S3Proxy", S3ProxyError)


class S3Proxy(ProcessService):
    """One S3Proxy server on 127.0.0.1 storing in a temporary directory.

    ``endpoint`` is ``http://127.0.0.1:PORT`` once ``start()`` returned;
    ``access_key`` and ``secret_key`` are the only credentials it accepts.
    ``provider`` is the blob store: ``filesystem-nio2`` (S3Proxy's file store,
    objects as files under ``basedir``, one directory per bucket), jclouds'
    ``filesystem`` (the same, deprecated by S3Proxy: it lists directories as
    objects) or ``transient`` (in the JVM's memory, ``heap``)."""

    def __init__(self, *, provider: str = "filesystem-nio2", heap: str = "512m") -> None:
        self.classpath = os.pathsep.join(str(p) for p in jars.jars("s3proxy"))
        super().__init__("s3proxy-", "s3proxy.log")
        self.provider = provider
        self.heap = heap
        self.access_key = f"tp{secrets.token_hex(6)}"
        self.secret_key = secrets.token_hex(20)
        self.region = REGION
        self.port: int | None = None
        self.basedir = self.workdir / "data"

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``, the URL of every bucket (path-style)."""
        if self.port is None:
            raise S3ProxyError("S3Proxy has not been started yet")
        return f"http://127.0.0.1:{self.port}"

    def _properties(self) -> Path:
        props = {
            "s3proxy.endpoint": self.endpoint,
            "s3proxy.authorization": "aws-v2-or-v4",
            "s3proxy.identity": self.access_key,
            "s3proxy.credential": self.secret_key,
            # boto3 since 1.36 and the AWS SDK of S3A send x-amz-checksum-crc32 and
            # x-amz-checksum-mode, which S3Proxy refuses (501 NotImplemented) unless
            # told to ignore x-amz-* headers it does not know; it then ignores them
            "s3proxy.ignore-unknown-headers": "true",
            "jclouds.provider": self.provider,
            "jclouds.filesystem.basedir": str(self.basedir),
            # S3Proxy asks every store but filesystem and transient for credentials;
            # the file stores check none
            "jclouds.identity": "local",
            "jclouds.credential": "local",
        }
        path = self.workdir / "s3proxy.conf"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def _logback(self) -> Path:
        """A logback configuration of INFO to the console (S3Proxy's jar has
        none, and logback's default logs every Jetty event at DEBUG)."""
        path = self.workdir / "logback.xml"
        path.write_text(_LOGBACK)
        return path

    def start(self, timeout: float = 60.0) -> None:
        """Start the server and wait until it answers HTTP on its port."""
        if self.is_running():
            return
        if self.port is None:
            self.port = free_port()
        self.basedir.mkdir(parents=True, exist_ok=True)
        props = self._properties()
        self._spawn(
            [
                _java(),
                f"-Xmx{self.heap}",
                "-XX:TieredStopAtLevel=1",  # starts faster; a test server needs no C2
                "-Djava.awt.headless=true",
                f"-Dlogback.configurationFile={self._logback()}",
                "-cp",
                self.classpath,
                MAIN,
                "--properties",
                str(props),
            ]
        )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _check_alive(self) -> None:
        status = self._exit_status()
        if status is not None:
            raise S3ProxyError(f"S3Proxy exited with status {status}\n{self.log_tail()}")

    def _wait_ready(self, timeout: float) -> None:
        """Until an unsigned GET of ``/`` gets an HTTP answer (403: S3Proxy's
        handler is serving; a refused connection: not yet)."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=2.0).close()
                return
            except urllib.error.HTTPError:
                return  # an answer, if a refusal: the server is up
            except OSError as e:
                last = e
                time.sleep(0.2)
        raise S3ProxyError(
            f"S3Proxy on {self.endpoint} did not answer within {timeout:.0f}s ({last})\n"
            f"{self.log_tail()}"
        )

    def client(self) -> Any:
        """A boto3 S3 client of this server (boto3: ``twophase[s3]``)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}),
        )

    def create_bucket(self, name: str) -> None:
        """Create the empty bucket ``name``."""
        self.client().create_bucket(Bucket=name)

    def delete_bucket(self, name: str) -> None:
        """Delete every object of bucket ``name`` (and uploads left unfinished),
        then the bucket; a missing bucket is fine."""
        from botocore.exceptions import ClientError

        c = self.client()
        try:
            for page in c.get_paginator("list_objects_v2").paginate(Bucket=name):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    c.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
            for up in c.list_multipart_uploads(Bucket=name).get("Uploads", []):
                c.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
            c.delete_bucket(Bucket=name)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") != "NoSuchBucket":
                raise

    def storage_options(self) -> dict[str, str]:
        """deltalake's (object_store's) options for this server: endpoint,
        credentials, region, plain HTTP, path-style. ``DeltaSink(...,
        storage_options=...)`` takes them."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
            "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
        }

    def spark_conf(self) -> dict[str, str]:
        """A Spark session's settings for Hadoop's S3A on this server
        (:func:`s3a_conf`); the session needs the ``s3a`` jars too."""
        return s3a_conf(self.endpoint, self.access_key, self.secret_key, self.region)


def s3a_conf(
    endpoint: str, access_key: str, secret_key: str, region: str = REGION
) -> dict[str, str]:
    """``spark.hadoop.fs.s3a.*`` settings that point Hadoop's S3A at an
    S3-compatible server on ``endpoint`` (``http://host:port``): its
    credentials (simple, static), path-style access, no TLS, the region to
    sign for, and no bucket probe (S3A's existence check of the bucket at
    first use costs a request and adds nothing here). Add the ``s3a`` jars
    (:mod:`lifecycle.testing.jars`) to the session with ``spark.jars``."""
    prefix = "spark.hadoop.fs.s3a."
    return {
        "spark.hadoop.fs.s3a.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
        prefix + "endpoint": endpoint,
        prefix + "endpoint.region": region,
        prefix + "path.style.access": "true",
        prefix + "connection.ssl.enabled": "false",
        prefix + "access.key": access_key,
        prefix + "secret.key": secret_key,
        prefix
        + "aws.credentials.provider": "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider",
        prefix + "bucket.probe": "0",
    }


def main(argv: list[str] | None = None) -> None:
    """Start a server, print its endpoint and keys, wait for Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--bucket", action="append", default=[], help="a bucket to create")
    args = parser.parse_args(argv)
    server = S3Proxy()

    def address() -> str:
        for b in args.bucket:
            server.create_bucket(b)
        return (
            f"{server.endpoint} AWS_ACCESS_KEY_ID={server.access_key} "
            f"AWS_SECRET_ACCESS_KEY={server.secret_key} buckets={','.join(args.bucket)}"
        )

    serve(server, address, server._check_alive)


if __name__ == "__main__":
    main()
