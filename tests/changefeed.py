"""A change feed for keyed-write tests: inserts, updates and deletes of
overlapping keys, and the dictionary model of what a keyed sink must hold."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

SCHEMA = "id long, seq long, op string, name string"
"""the feed's Spark schema: ``op`` is I, U or D; ``seq`` orders the rows of a key"""


def write_feed(
    directory: Path, *, files: int, rows_per_file: int, keys: int, seed: int
) -> dict[int, dict[str, Any]]:
    """Write ``files`` JSON-lines files (read one per batch, in order: their
    modification times go up) and return the model: each key's last row (by
    ``seq``, which grows through the feed) without ``op``; deleted keys absent."""
    directory.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(seed)
    model: dict[int, dict[str, Any]] = {}
    seq = 0
    for f in range(files):
        rows = []
        for _ in range(rows_per_file):
            seq += 1
            rows.append(
                {"id": rnd.randrange(keys), "seq": seq, "op": rnd.choice("IUD"), "name": f"n{seq}"}
            )
        for r in rows:
            if r["op"] == "D":
                model.pop(r["id"], None)
            else:
                model[r["id"]] = {k: v for k, v in r.items() if k != "op"}
        rnd.shuffle(rows)  # the order within a batch is seq's to say, not the file's
        part = directory / f"part-{f:05d}.json"
        part.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.utime(part, (1_700_000_000 + f, 1_700_000_000 + f))
    return model


HOSTILE_SCHEMA = "region string, id long, seq long, op string, name string, k string"
"""a feed keyed by ``(region, id)`` whose ``region`` is often "" (a key column,
and Delta's partition column), whose ``name`` is often null or "", with ``k``
the key as one string (``region/id``) for a Kafka changelog"""


def write_hostile_feed(
    directory: Path, *, files: int, rows_per_file: int, keys: int, seed: int
) -> dict[tuple[str, int], dict[str, Any]]:
    """Like :func:`write_feed`, keyed by ``(region, id)``: the model maps each
    live key to its last row (without ``op``)."""
    directory.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(seed)
    model: dict[tuple[str, int], dict[str, Any]] = {}
    seq = 0
    for f in range(files):
        rows = []
        for _ in range(rows_per_file):
            seq += 1
            region, i = rnd.choice(("", "", "a", "b")), rnd.randrange(keys)
            name = rnd.choice((None, "", f"n{seq}", f"n{seq}"))
            op = rnd.choice("IUD")
            rows.append(
                {
                    "region": region,
                    "id": i,
                    "seq": seq,
                    "op": op,
                    "name": name,
                    "k": f"{region}/{i}",
                }
            )
        for r in rows:
            if r["op"] == "D":
                model.pop((r["region"], r["id"]), None)
            else:
                model[(r["region"], r["id"])] = {k: v for k, v in r.items() if k != "op"}
        rnd.shuffle(rows)
        part = directory / f"part-{f:05d}.json"
        part.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.utime(part, (1_700_000_000 + f, 1_700_000_000 + f))
    return model
