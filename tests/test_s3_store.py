"""Which S3 features the tests' S3 servers honour, measured against the running
servers with boto3: S3Proxy (``lifecycle/testing/s3proxy.py``, the kit's S3
server, with its default ``filesystem-nio2`` store, and in the slow tier with
jclouds' ``filesystem`` and ``transient`` stores) and moto's server
(``tests/s3server.py``).

:data:`EXPECTED` is the table of ``docs/testing.md`` ("Which S3 features the
servers honour"): each probe asserts that its server still answers as the
table says, and :func:`test_the_table_in_the_docs_is_the_measured_one` that the
page shows exactly this table. A new server version that changes an answer
fails here, naming the cell to update.

What the project leans on: ``If-None-Match: *`` on PUT (delta-rs creates each
commit file with it, and the Delta sink its staging markers,
:mod:`sinks.delta.exclusive`): a second create of a key must get 412 and
leave the first content. S3Proxy does that for one writer after another, but
checks before it writes, so writers racing on one key may all succeed (the
row "8 writers at once"): it proves what one writer at a time does against a
real server, not the safety of concurrent commits, which moto's server (and
AWS S3) give.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lifecycle.testing import jars
from tests.tiers import SLOW

ROOT = Path(__file__).resolve().parents[1]

SERVERS = ["s3proxy", "s3proxy-filesystem", "s3proxy-transient", "moto"]
"""the columns of the table: S3Proxy with its store ``filesystem-nio2`` (the
kit's default), jclouds' ``filesystem`` (deprecated by S3Proxy) and
``transient`` (memory), and moto's server"""
HEADINGS = {
    "s3proxy": "S3Proxy 2.9.0, `filesystem-nio2` (the kit's)",
    "s3proxy-filesystem": "S3Proxy, `filesystem`",
    "s3proxy-transient": "S3Proxy, `transient`",
    "moto": "moto server",
}

OK = "yes"
P412 = "412, first content kept"
OVERWRITES = "ignored: overwrites"

EXPECTED: dict[str, tuple[str, dict[str, str]]] = {
    "put_if_none_match": (
        "PUT `If-None-Match: *` on an existing key",
        dict.fromkeys(SERVERS, P412),
    ),
    "put_if_none_match_race": (
        "the same, 8 writers at once on a new key",
        {
            "s3proxy": "several may win",
            "s3proxy-filesystem": "several may win",
            "s3proxy-transient": "several may win",
            "moto": "one wins",
        },
    ),
    "put_if_match": ("PUT `If-Match` with a stale ETag", dict.fromkeys(SERVERS, P412)),
    "get_if_match": ("GET `If-Match` with a stale ETag", dict.fromkeys(SERVERS, "412")),
    "complete_if_none_match": (
        "CompleteMultipartUpload `If-None-Match: *` on an existing key",
        {
            "s3proxy": OVERWRITES,
            "s3proxy-filesystem": OVERWRITES,
            "s3proxy-transient": OVERWRITES,
            "moto": P412,
        },
    ),
    "copy": ("CopyObject", dict.fromkeys(SERVERS, OK)),
    "multipart": ("multipart upload (5 MiB + 10 bytes)", dict.fromkeys(SERVERS, OK)),
    "list_delimiter": ("ListObjectsV2, prefix and delimiter", dict.fromkeys(SERVERS, OK)),
    "list_continuation": ("ListObjectsV2, pages by continuation token", dict.fromkeys(SERVERS, OK)),
    "list_objects_only": (
        "a listing holds objects only (no directories)",
        {
            "s3proxy": OK,
            "s3proxy-filesystem": "no: lists each directory as a key `d/`",
            "s3proxy-transient": OK,
            "moto": OK,
        },
    ),
    "dir_marker": (
        "an empty `d/` object (S3A's directory marker)",
        {
            "s3proxy": "no: HEAD `d` finds it; not listed under `d/`",
            "s3proxy-filesystem": "no: not listed under `d/`",
            "s3proxy-transient": OK,
            "moto": OK,
        },
    ),
    "delete": ("DeleteObject (also of a missing key), DeleteObjects", dict.fromkeys(SERVERS, OK)),
    "checksum": (
        "PUT with a wrong `x-amz-checksum-crc32`, a wrong `Content-MD5`",
        {
            "s3proxy": "CRC32 ignored, MD5 refused (400)",
            "s3proxy-filesystem": "CRC32 ignored, MD5 refused (400)",
            "s3proxy-transient": "CRC32 ignored, MD5 refused (400)",
            "moto": "CRC32 ignored, MD5 ignored",
        },
    ),
}
"""probe -> (row of the table, server -> what it answers)"""


# -- servers ------------------------------------------------------------------------------


@dataclass
class Store:
    """A running server under its column's name, and a fresh bucket on it."""

    name: str
    client: Any
    bucket: str


@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=() if n in ("s3proxy", "moto") else SLOW) for n in SERVERS],
)
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """Each server in turn, for the module's tests of it (the kit's S3Proxy is
    the session's ``twophase_s3``)."""
    name: str = request.param
    if name == "s3proxy":
        yield name, request.getfixturevalue("twophase_s3")
    elif name == "moto":
        pytest.importorskip("moto.server", reason="moto[server] is not installed")
        from tests.s3server import S3Server

        with S3Server() as moto:
            yield name, moto
    else:
        from lifecycle.testing.s3proxy import S3Proxy

        jars.require("s3proxy")
        with S3Proxy(provider=name.removeprefix("s3proxy-")) as proxy:
            yield name, proxy


@pytest.fixture
def store(server: tuple[str, Any]) -> Store:
    name, running = server
    bucket = f"p-{uuid.uuid4().hex[:12]}"
    running.create_bucket(bucket)
    return Store(name, running.client(), bucket)


# -- probes -------------------------------------------------------------------------------


def _status(call: Callable[[], Any]) -> tuple[int, str]:
    """HTTP status and error code of an S3 call (200 and "" when it succeeded)."""
    from botocore.exceptions import ClientError

    try:
        call()
        return 200, ""
    except ClientError as e:
        return int(e.response["ResponseMetadata"]["HTTPStatusCode"]), str(
            e.response.get("Error", {}).get("Code", "")
        )


def _body(s: Store, key: str) -> bytes:
    return bytes(s.client.get_object(Bucket=s.bucket, Key=key)["Body"].read())


def _conditional(status: int, body: bytes, first: bytes, second: bytes, code: str = "") -> str:
    """What a conditional write that should have been refused did."""
    if status == 412 and body == first:
        return P412
    if status == 200 and body == second:
        return OVERWRITES
    return f"{status} {code}, left {body!r}"


def probe_put_if_none_match(s: Store) -> str:
    c, b = s.client, s.bucket
    assert _status(lambda: c.put_object(Bucket=b, Key="k", Body=b"first", IfNoneMatch="*")) == (
        200,
        "",
    ), "a create of a new key must succeed"
    status, code = _status(lambda: c.put_object(Bucket=b, Key="k", Body=b"two", IfNoneMatch="*"))
    return _conditional(status, _body(s, "k"), b"first", b"two", code)


def probe_put_if_none_match_race(s: Store, rounds: int = 10) -> str:
    """8 threads create one new key at once, ``rounds`` times: whether S3
    ever told more than one of them that it created the key."""
    winners = [_race(s, f"race-{r}", 8) for r in range(rounds)]
    assert min(winners) >= 1, "no writer created the key"
    return "several may win" if max(winners) > 1 else "one wins"


def _race(s: Store, key: str, writers: int) -> int:
    """How many of ``writers`` threads creating ``key`` at once succeed."""
    won: list[int] = []
    refused: list[int] = []
    gate = threading.Barrier(writers)

    def write(i: int) -> None:
        gate.wait()
        body = bytes([i]) * 65536  # a body that takes a moment to arrive
        status, _ = _status(
            lambda: s.client.put_object(Bucket=s.bucket, Key=key, Body=body, IfNoneMatch="*")
        )
        (won if status == 200 else refused).append(status)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(refused) <= {412}, f"a create was refused otherwise than with 412: {refused}"
    return len(won)


def probe_put_if_match(s: Store) -> str:
    c, b = s.client, s.bucket
    etag = c.put_object(Bucket=b, Key="k", Body=b"first")["ETag"]
    status, code = _status(lambda: c.put_object(Bucket=b, Key="k", Body=b"two", IfMatch='"0"'))
    got = _conditional(status, _body(s, "k"), b"first", b"two", code)
    if got == P412:
        assert _status(lambda: c.put_object(Bucket=b, Key="k", Body=b"3", IfMatch=etag))[0] == 200
        assert _body(s, "k") == b"3", "a PUT with the current ETag must replace the object"
    return got


def probe_get_if_match(s: Store) -> str:
    c, b = s.client, s.bucket
    c.put_object(Bucket=b, Key="k", Body=b"first")
    status, _ = _status(lambda: c.get_object(Bucket=b, Key="k", IfMatch='"0"'))
    return "412" if status == 412 else f"ignored ({status})"


def probe_complete_if_none_match(s: Store) -> str:
    c, b = s.client, s.bucket
    c.put_object(Bucket=b, Key="k", Body=b"first")
    up = c.create_multipart_upload(Bucket=b, Key="k")["UploadId"]
    part = c.upload_part(Bucket=b, Key="k", UploadId=up, PartNumber=1, Body=b"two")
    status, code = _status(
        lambda: c.complete_multipart_upload(
            Bucket=b,
            Key="k",
            UploadId=up,
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
            IfNoneMatch="*",
        )
    )
    if status != 200:
        _status(lambda: c.abort_multipart_upload(Bucket=b, Key="k", UploadId=up))
    return _conditional(status, _body(s, "k"), b"first", b"two", code)


def probe_copy(s: Store) -> str:
    c, b = s.client, s.bucket
    c.put_object(Bucket=b, Key="src", Body=b"payload")
    c.copy_object(Bucket=b, Key="dst", CopySource={"Bucket": b, "Key": "src"})
    return OK if _body(s, "dst") == b"payload" and _body(s, "src") == b"payload" else "no"


def probe_multipart(s: Store) -> str:
    c, b = s.client, s.bucket
    first, tail = b"a" * (5 * 1024 * 1024), b"b" * 10
    up = c.create_multipart_upload(Bucket=b, Key="mp")["UploadId"]
    parts = [
        {"PartNumber": n, "ETag": c.upload_part(**_part(b, up, n, body))["ETag"]}
        for n, body in ((1, first), (2, tail))
    ]
    c.complete_multipart_upload(Bucket=b, Key="mp", UploadId=up, MultipartUpload={"Parts": parts})
    size = c.head_object(Bucket=b, Key="mp")["ContentLength"]
    return OK if size == len(first) + len(tail) and _body(s, "mp") == first + tail else "no"


def _part(bucket: str, upload: str, n: int, body: bytes) -> dict[str, Any]:
    return {"Bucket": bucket, "Key": "mp", "UploadId": upload, "PartNumber": n, "Body": body}


def probe_list_delimiter(s: Store) -> str:
    c, b = s.client, s.bucket
    for k in ("d/f0", "d/f1", "d/x/0", "d/x/1", "e/0"):
        c.put_object(Bucket=b, Key=k, Body=b"x")
    r = c.list_objects_v2(Bucket=b, Prefix="d/", Delimiter="/")
    keys = [o["Key"] for o in r.get("Contents", [])]
    prefixes = [p["Prefix"] for p in r.get("CommonPrefixes", [])]
    return OK if (keys, prefixes) == (["d/f0", "d/f1"], ["d/x/"]) else f"no: {keys} {prefixes}"


def probe_list_continuation(s: Store) -> str:
    c, b = s.client, s.bucket
    want = [f"p/{i:02d}" for i in range(7)]
    for k in want:
        c.put_object(Bucket=b, Key=k, Body=b"x")
    got: list[str] = []
    token: dict[str, str] = {}
    while True:
        r = c.list_objects_v2(Bucket=b, Prefix="p/", MaxKeys=2, **token)
        got += [o["Key"] for o in r.get("Contents", [])]
        if not r.get("IsTruncated"):
            break
        token = {"ContinuationToken": r["NextContinuationToken"]}
    return OK if got == want else f"no: {got}"


def probe_list_objects_only(s: Store) -> str:
    c, b = s.client, s.bucket
    c.put_object(Bucket=b, Key="a/b/c", Body=b"x")
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=b).get("Contents", [])]
    if keys == ["a/b/c"]:
        return OK
    if set(keys) == {"a/", "a/b/", "a/b/c"}:
        return "no: lists each directory as a key `d/`"
    return f"no: {keys}"


def probe_dir_marker(s: Store) -> str:
    c, b = s.client, s.bucket
    c.put_object(Bucket=b, Key="m/d/", Body=b"")
    wrong = []
    if _status(lambda: c.head_object(Bucket=b, Key="m/d"))[0] != 404:
        wrong.append("HEAD `d` finds it")
    listed = [o["Key"] for o in c.list_objects_v2(Bucket=b, Prefix="m/d/").get("Contents", [])]
    if listed != ["m/d/"]:
        wrong.append("not listed under `d/`")
    assert _status(lambda: c.head_object(Bucket=b, Key="m/d/"))[0] == 200
    return "no: " + "; ".join(wrong) if wrong else OK


def probe_delete(s: Store) -> str:
    c, b = s.client, s.bucket
    for k in ("x", "y", "z"):
        c.put_object(Bucket=b, Key=k, Body=b"x")
    c.delete_object(Bucket=b, Key="x")
    missing = _status(lambda: c.delete_object(Bucket=b, Key="never-was"))[0]
    c.delete_objects(Bucket=b, Delete={"Objects": [{"Key": "y"}, {"Key": "z"}]})
    left = [o["Key"] for o in c.list_objects_v2(Bucket=b).get("Contents", [])]
    return OK if left == [] and missing in (200, 204) else f"no: {left}, missing key: {missing}"


def probe_checksum(s: Store) -> str:
    def put(**check: str) -> str:
        status, _ = _status(
            lambda: s.client.put_object(Bucket=s.bucket, Key="k", Body=b"payload", **check)
        )
        return "ignored" if status == 200 else f"refused ({status})"

    crc = put(ChecksumCRC32="AAAAAA==")
    md5 = put(ContentMD5="AAAAAAAAAAAAAAAAAAAAAA==")
    return f"CRC32 {crc}, MD5 {md5}"


PROBES: dict[str, Callable[[Store], str]] = {
    name.removeprefix("probe_"): fn for name, fn in globals().items() if name.startswith("probe_")
}


@pytest.mark.parametrize("feature", list(EXPECTED))
def test_the_server_answers_as_the_table_says(store: Store, feature: str) -> None:
    row, expected = EXPECTED[feature]
    got = PROBES[feature](store)
    assert got == expected[store.name], (
        f"{store.name}, {row!r}: the server now answers {got!r}, docs/testing.md says "
        f"{expected[store.name]!r}: update EXPECTED in tests/test_s3_store.py and the table"
    )


def test_every_feature_has_a_probe() -> None:
    assert set(PROBES) == set(EXPECTED)


def test_the_table_in_the_docs_is_the_measured_one() -> None:
    """docs/testing.md shows :data:`EXPECTED`, row for row."""
    page = (ROOT / "docs" / "testing.md").read_text()
    header = "| feature | " + " | ".join(HEADINGS[n] for n in SERVERS) + " |"
    assert header in page, f"docs/testing.md lacks the table header {header!r}"
    lines = page[page.index(header) :].splitlines()[2:]
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows[cells[0]] = cells[1:]
    want = {row: [by_server[n] for n in SERVERS] for row, by_server in EXPECTED.values()}
    assert rows == want
