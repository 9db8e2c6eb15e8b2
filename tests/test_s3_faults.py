"""Faults of the S3 store under a real job: ``DeltaSink("s3://...")`` on S3Proxy.

* **Throttling.** Every third request to the store is answered ``503 Slow
  Down`` by a proxy in front of S3Proxy (:mod:`lifecycle.testing.s3faults`):
  deltalake's object store, boto3 (the staging markers' conditional PUTs) and
  Hadoop's S3A (delta-spark's read back) all go through it. The job finishes,
  the table is exact, and the proxy did throttle.
* **The server stopped in the middle of a commit, then started again.** The
  driver stalls at a commit's fault point (``driver.before_commit``: before
  the Delta version is written; ``driver.mid_commit``: after it, before the
  staging markers are deleted); the test stops S3Proxy there and starts it
  again 20 s later. Meanwhile the driver's commit meets a refused connection
  (it retries: :func:`sinks._retry.retry_transient`) and so do the next
  batch's tasks, whose staging markers are retried the same way
  (:mod:`sinks.delta.exclusive`). The job rides it out: exit 0, every row
  once, nothing staged left. Before those retries, the tasks failed within a
  second and the job died (``TaskFailedError: ... EndpointConnectionError``).
* **Credentials wrong or missing, or no such bucket**: refused at preflight,
  naming the table and what the store said, without the secret; a
  ``state_dir`` on ``s3a://`` whose credentials the store refuses, likewise
  (``twophase status``, the state store in a JVM of its own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from lifecycle.testing import jars
from lifecycle.testing.s3faults import ThrottlingProxy
from sinks import DeltaSink
from sinks.errors import PreflightError
from tests.conftest import write_input
from tests.procs import ROOT, JobProcess, wait_for
from tests.test_delta_s3 import check_log, check_table, job_args, s3_jars  # noqa: F401 (a fixture)
from tests.tiers import SLOW


def finished(job: JobProcess, n: int) -> dict[str, Any]:
    """What the job printed, once it exited 0 having committed all ``n`` rows."""
    assert job.proc.returncode == 0, job.tail()
    result = job.result()
    assert result["committed"] and result["rows"] == {"load/orders": n}, result
    out = job.output()
    read = json.loads(out.rsplit("READ ", 1)[1].splitlines()[0]) if "READ " in out else None
    return {"n": n, "result": result, "read": read}


@SLOW  # a minute; the throttling is retried by the clients (deltalake, boto3, S3A) alike
@pytest.mark.usefixtures("s3_jars")
def test_a_job_rides_out_a_store_that_throttles_every_third_request(
    twophase_s3: Any, twophase_s3_bucket: str, tmp_path: Path
) -> None:
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    with ThrottlingProxy(twophase_s3.endpoint, every=3) as proxy:
        job = JobProcess(
            "delta_store_job.py",
            job_args(twophase_s3, twophase_s3_bucket, tmp_path, endpoint=proxy.endpoint),
            tmp_path / "job.log",
        )
        job.wait(400)
        print(f"throttled {proxy.throttled}, forwarded {proxy.forwarded}")
        assert proxy.throttled >= 20, "the proxy throttled too little to show anything"
    check_table(twophase_s3, twophase_s3_bucket, finished(job, n))


@pytest.mark.crash
@pytest.mark.parametrize(
    "point",
    [
        pytest.param("driver.before_commit", id="before the version is written"),
        pytest.param(
            "driver.mid_commit.delta", id="after the version, before the cleanup", marks=SLOW
        ),
    ],
)
def test_a_job_rides_out_the_store_stopped_in_the_middle_of_a_commit(
    twophase_s3: Any, twophase_s3_bucket: str, tmp_path: Path, point: str
) -> None:
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    job = JobProcess(
        "delta_store_job.py",
        [
            *job_args(twophase_s3, twophase_s3_bucket, tmp_path),
            "--no-read-back",
        ],
        tmp_path / "job.log",
        fault=f"{point}@1+once=stall:3",
        env={"TWOPHASE_FAULT_TOKENS": str(tokens)},
    )
    wait_for(lambda: any(tokens.iterdir()), 300, f"the driver reached {point}", job)
    twophase_s3.stop()
    time.sleep(20)
    assert job.proc.poll() is None, "the job gave up while the store was down:\n" + job.tail()
    twophase_s3.start()
    job.wait(400)
    log = job.output()
    assert "retrying" in log, "nothing met the stopped store: the test shows nothing"
    finished(job, n)
    check_log(twophase_s3, twophase_s3_bucket, n)


SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("wrong secret", "SignatureDoesNotMatch"),
        ("unknown key", "InvalidAccessKeyId"),
        ("no credentials", "no credentials"),
        ("no such bucket", "NoSuchBucket"),
    ],
)
def test_a_store_that_refuses_the_sink_is_refused_at_preflight_without_the_secret(
    twophase_s3: Any, twophase_s3_bucket: str, case: str, said: str, monkeypatch: Any
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    options = twophase_s3.storage_options()
    secret = "wrongsecret" + "9" * 29
    bucket = twophase_s3_bucket
    if case == "wrong secret":
        options["AWS_SECRET_ACCESS_KEY"] = secret
    elif case == "unknown key":
        options["AWS_ACCESS_KEY_ID"] = "tpnosuchkey000"
    elif case == "no credentials":
        del options["AWS_ACCESS_KEY_ID"], options["AWS_SECRET_ACCESS_KEY"]
    else:
        bucket = "no-such-bucket"
    uri = f"s3://{bucket}/orders"
    began = time.monotonic()
    with pytest.raises(PreflightError) as e:
        DeltaSink(uri, storage_options=options).preflight(SCHEMA)
    message = str(e.value)
    print(message)
    assert uri in message and said in message, message
    assert "\x1b[" not in message, "terminal colour codes in the message"
    for value in (secret, twophase_s3.secret_key):
        assert value not in message
    assert time.monotonic() - began < 30, "the refusal took as long as an outage's retries"


def test_the_proxy_throttles_what_it_says(twophase_s3: Any, twophase_s3_bucket: str) -> None:
    """The proxy's own check: a client with no retries sees the 503, and
    ``paused()`` lets everything through."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    jars.require("s3proxy")
    with ThrottlingProxy(twophase_s3.endpoint, every=2) as proxy:
        client = boto3.client(
            "s3",
            endpoint_url=proxy.endpoint,
            aws_access_key_id=twophase_s3.access_key,
            aws_secret_access_key=twophase_s3.secret_key,
            region_name=twophase_s3.region,
            config=Config(retries={"total_max_attempts": 1, "mode": "standard"}),
        )
        codes = []
        for i in range(4):
            try:
                client.put_object(Bucket=twophase_s3_bucket, Key=f"k{i}", Body=b"x")
                codes.append("ok")
            except ClientError as e:
                codes.append(e.response["Error"]["Code"])
        assert codes == ["ok", "SlowDown", "ok", "SlowDown"]
        with proxy.paused():
            for i in range(4):
                client.put_object(Bucket=twophase_s3_bucket, Key=f"p{i}", Body=b"x")
        assert (proxy.throttled, proxy.forwarded) == (2, 6)


@pytest.mark.usefixtures("s3_jars")
@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("wrong secret", "403"),
        ("no credentials", "No AWS credentials"),
    ],
)
def test_a_state_dir_the_store_refuses_is_refused_by_name_without_the_secret(
    twophase_s3: Any, twophase_s3_bucket: str, case: str, said: str
) -> None:
    """``twophase status s3a://...`` (the state store in a JVM of its own,
    configured as a job's session would be, from ``PYSPARK_SUBMIT_ARGS``): a
    one-line refusal that names the ``state_dir``, says what the store said
    and what to check, and shows no secret; no Java stack trace."""
    secret = "wrongsecret" + "7" * 29
    conf = twophase_s3.spark_conf()
    if case == "wrong secret":
        conf["spark.hadoop.fs.s3a.secret.key"] = secret
    else:
        del conf["spark.hadoop.fs.s3a.access.key"], conf["spark.hadoop.fs.s3a.secret.key"]
    submit = ["--driver-class-path", os.pathsep.join(str(p) for p in jars.jars("s3a"))]
    for k, v in conf.items():
        submit += ["--conf", f"{k}={v}"]
    state = f"s3a://{twophase_s3_bucket}/state"
    status = subprocess.run(
        [sys.executable, "-m", "lifecycle.cli", "status", state],
        env={**os.environ, "PYSPARK_SUBMIT_ARGS": " ".join([*submit, "pyspark-shell"])},
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    out = status.stdout + status.stderr
    assert status.returncode == 2, out
    refusal = [line for line in out.splitlines() if line.startswith("twophase: ")]
    assert len(refusal) == 1 and f"state_dir {state}: the file system refused" in refusal[0], out
    assert said in refusal[0] and "fs.s3a.secret.key" in refusal[0], refusal
    assert "Traceback" not in out and "\tat " not in out, out
    for value in (secret, twophase_s3.secret_key):
        assert value not in out


def test_an_audit_without_the_key_id_says_so_in_one_plain_line(
    twophase_s3: Any, twophase_s3_bucket: str, monkeypatch: Any
) -> None:
    """``twophase audit`` rebuilds the sink from its recorded settings, which
    keep neither the key id nor the secret: with only the secret in the
    environment the table cannot be read, and the audit's line says why."""
    from sinks.base import JobScope

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    options = twophase_s3.storage_options()
    del options["AWS_ACCESS_KEY_ID"]
    sink = DeltaSink(f"s3://{twophase_s3_bucket}/orders", storage_options=options)
    with pytest.raises(OSError) as e:
        sink.committer().audit(JobScope("j", "p", sink.sink_id, "0123456789ab"), [])
    message = str(e.value)
    assert "no credentials" in message and "AWS_ACCESS_KEY_ID" in message, message
    assert "\x1b[" not in message and twophase_s3.secret_key not in message, message
