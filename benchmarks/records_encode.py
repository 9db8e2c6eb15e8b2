"""Encoding speed of Kafka record batches: sinks.kafka.records against kafka-python.

No broker, no Spark: rows {key ~8 bytes, value ~80 bytes} (and one header in a
second run) encoded into v2 record batches of at most 1 MiB,

* by :func:`sinks.kafka.records.record_batches`, column-wise from Arrow
  (uncompressed, then with each codec whose library is installed);
* by kafka-python's ``DefaultRecordBatchBuilder``, one ``append`` per record, as
  its producer does (uncompressed);

and the keys hashed by :func:`sinks.kafka.partitioner.murmur2` against
``kafka.partitioner.default.murmur2``. Prints rows per second (best of
``--repeat`` for the vectorised code but gzip, one run of gzip and of the
per-record loops).

    python benchmarks/records_encode.py [--rows N] [--repeat R]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import kafka.codec as codecs
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from kafka.partitioner.default import murmur2 as kafka_murmur2
from kafka.record.default_records import DefaultRecordBatchBuilder

from sinks.kafka.partitioner import murmur2
from sinks.kafka.records import record_batches

PRODUCER = {"producer_id": 1000, "producer_epoch": 0, "transactional": True, "timestamp_ms": 0}
MAX_BATCH = 1 << 20


def make_rows(rows: int) -> tuple[pa.Array, pa.Array, pa.Array]:
    """Keys ``k0000042`` (8 bytes), values of 70-90 bytes (80 on average) of JSON-like text, and a
    header value per row (null every tenth row)."""
    rng = np.random.default_rng(0)
    keys = pa.array([b"k%07d" % i for i in range(rows)], pa.binary())
    pad = rng.integers(17, 38, rows)
    values = pa.array(
        [
            b'{"id": %8d, "name": "customer-%04d", "note": "%s"}' % (i, i % 1000, b"x" * p)
            for i, p in enumerate(pad.tolist())
        ],
        pa.binary(),
    )
    trace = pa.array([None if i % 10 == 0 else b"trace-%d" % i for i in range(rows)], pa.binary())
    return keys, values, trace


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def kafka_python_batches(
    keys: list[bytes], values: list[bytes], headers: list[list[tuple[str, bytes]]] | None
) -> list[bytes]:
    """kafka-python's builder, as its producer uses it: one append per record,
    a new batch when the current one is full."""
    out = []
    sequence = 0
    builder = DefaultRecordBatchBuilder(2, 0, True, 1000, 0, sequence, MAX_BATCH)
    offset = 0
    no_headers: list[tuple[str, bytes]] = []
    for i, (key, value) in enumerate(zip(keys, values, strict=True)):
        hdrs = no_headers if headers is None else headers[i]
        if builder.append(offset, 0, key, value, hdrs) is None:
            out.append(bytes(builder.build()))
            sequence += offset
            builder = DefaultRecordBatchBuilder(2, 0, True, 1000, 0, sequence, MAX_BATCH)
            offset = 0
            builder.append(offset, 0, key, value, hdrs)
        offset += 1
    out.append(bytes(builder.build()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows, repeat = args.rows, args.repeat

    keys, values, trace = make_rows(rows)
    key_len = pc.mean(pc.binary_length(keys)).as_py()
    value_len = pc.mean(pc.binary_length(values)).as_py()
    print(f"{rows:,} rows: key {key_len:.1f} bytes, value {value_len:.1f} bytes on average")

    def rate(seconds: float) -> str:
        return f"{rows / seconds / 1e6:7.2f} M rows/s  ({seconds * 1e3:8.1f} ms)"

    def ours(headers: list[tuple[str, pa.Array]], compression: str | None = None) -> float:
        # gzip at kafka-python's level 9 is slow: one run is enough to see it.
        return best(
            lambda: record_batches(
                keys,
                values,
                headers,
                base_sequence=0,
                compression=compression,
                max_batch_bytes=MAX_BATCH,
                **PRODUCER,
            ),
            1 if compression == "gzip" else repeat,
        )

    batches = record_batches(keys, values, base_sequence=0, **PRODUCER)
    size = sum(len(b.data) for b in batches)
    print(f"encoded: {len(batches)} batches, {size / 1e6:.1f} MB")
    print(f"records.record_batches, plain              {rate(ours([]))}")
    print(f"records.record_batches, plain, 1 header    {rate(ours([('trace', trace)]))}")
    available = {
        "gzip": codecs.has_gzip,
        "snappy": codecs.has_snappy,
        "lz4": codecs.has_lz4,
        "zstd": codecs.has_zstd,
    }
    for codec, has in available.items():
        if has():
            print(f"records.record_batches, {codec:<6}             {rate(ours([], codec))}")
        else:
            print(f"records.record_batches, {codec:<6}             (library not installed)")

    py_keys, py_values = keys.to_pylist(), values.to_pylist()
    start = time.perf_counter()
    reference = kafka_python_batches(py_keys, py_values, None)
    print(f"kafka-python DefaultRecordBatchBuilder     {rate(time.perf_counter() - start)}")
    ours_plain = [b.data[:12] + b"\x00\x00\x00\x00" + b.data[16:] for b in batches]
    print(f"  same bytes (leader epoch aside): {ours_plain == reference}")
    py_headers = [[] if t is None else [("trace", t)] for t in trace.to_pylist()]
    start = time.perf_counter()
    kafka_python_batches(py_keys, py_values, py_headers)
    print(f"kafka-python DefaultRecordBatchBuilder, 1 hdr {rate(time.perf_counter() - start)}")

    print(
        f"partitioner.murmur2                         {rate(best(lambda: murmur2(keys), repeat))}"
    )
    start = time.perf_counter()
    expected = [kafka_murmur2(k) for k in py_keys]
    print(f"kafka.partitioner.default.murmur2          {rate(time.perf_counter() - start)}")
    print(f"  same hashes: {murmur2(keys).view(np.uint32).tolist() == expected}")


if __name__ == "__main__":
    main()
