"""The sink protocol's shape (no services): each sink's committer and the
capabilities it declares, a committer that stays on the driver, a sink
written for the protocol before the committer refused when it is defined,
and a sink of its own rebuilt by the ``twophase`` commands from its settings."""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from sinks import DeltaSink, KafkaSink, PostgresSink, from_settings
from sinks.base import Committer, Sink
from sinks.capabilities import (
    Audits,
    ExpiringWork,
    HoldsPreparedWork,
    LeasesIds,
    RetiresEvidence,
    StagesThroughSpark,
)
from sinks.errors import ConfigError
from tests.memory_sink import MemorySink

SINK_CAPS = (StagesThroughSpark, ExpiringWork, HoldsPreparedWork)
COMMITTER_CAPS = (LeasesIds, Audits, RetiresEvidence)


def _sinks(tmp_path: Path) -> dict[str, Sink]:
    return {
        "postgres": PostgresSink("postgresql://h/db", "t"),
        "postgres replace": PostgresSink("postgresql://h/db", "t", replace_where="d = 1"),
        "kafka": KafkaSink("localhost:9092", "t"),
        "delta": DeltaSink(str(tmp_path / "t")),
    }


EXPECTED = {
    "postgres": ({HoldsPreparedWork}, {Audits, RetiresEvidence}),
    "postgres replace": ({HoldsPreparedWork}, {Audits, RetiresEvidence}),
    "kafka": ({ExpiringWork, HoldsPreparedWork}, {LeasesIds, Audits}),
    "delta": ({StagesThroughSpark}, {Audits}),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_sink_declares_its_capabilities_and_keeps_one_committer(
    tmp_path: Path, kind: str
) -> None:
    sink = _sinks(tmp_path)[kind]
    committer = sink.committer()
    assert isinstance(committer, Committer)
    assert sink.committer() is committer  # the same object every call
    has = {c for c in SINK_CAPS if isinstance(sink, c)}
    committer_has = {c for c in COMMITTER_CAPS if isinstance(committer, c)}
    assert (has, committer_has) == EXPECTED[kind]
    # a replace holds no prepared transactions (it stages into a table)
    if isinstance(sink, HoldsPreparedWork):
        assert sink.holds_prepared_work() == (kind != "postgres replace")


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_the_committer_never_travels_to_the_executors(tmp_path: Path, kind: str) -> None:
    sink = _sinks(tmp_path)[kind]
    committer = sink.committer()
    assert all(v is not committer for v in sink.__getstate__().values())
    shipped = pickle.loads(pickle.dumps(sink))
    assert isinstance(shipped.committer(), Committer) and shipped.committer() is not committer


def test_a_sink_of_the_protocol_before_the_committer_is_refused() -> None:
    with pytest.raises(TypeError) as refused:

        class Old(PostgresSink):
            prepared_work_expires = True

            def abort_lingering(self, scope: object, is_orphan: object) -> list[str]:
                return []

            def lease(self, scope: object, batch_id: int) -> int | None:
                return None

    said = str(refused.value)
    assert "Old defines" in said
    assert "abort_lingering (sinks.committer.Committer: now sweep)" in said
    assert "lease (sinks.capabilities.LeasesIds, on the committer)" in said
    assert "prepared_work_expires (sinks.capabilities.ExpiringWork: inherit it instead)" in said

    class Expiring(PostgresSink, ExpiringWork):  # the capability inherited: accepted
        def prepared_work_timeout(self) -> float:
            return 60.0

    assert Expiring("postgresql://h/db", "t").prepared_work_timeout() == 60.0


class _Own(MemorySink):
    """A sink of its own kind, rebuilt by the twophase commands from its settings."""

    kind = "own"

    def __init__(self, target: str, sink_id: str = "own") -> None:
        super().__init__(sink_id)
        self.target = target

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "target": self.target}

    @classmethod
    def from_settings(cls, s: Mapping[str, Any], secrets: Mapping[str, str]) -> _Own:
        return cls(s["target"] + secrets.get("SUFFIX", ""), s["sink_id"])


class _NotRebuildable(MemorySink):
    kind = "plain"


def test_a_sink_of_its_own_is_rebuilt_from_the_class_its_settings_name() -> None:
    recorded = json.loads(json.dumps(_Own("t1", "s1").settings()))  # as the ledger keeps it
    assert recorded["class"] == "tests.test_protocol:_Own"
    again = from_settings(recorded, {"SUFFIX": "!"})
    assert isinstance(again, _Own) and (again.target, again.sink_id) == ("t1!", "s1")

    plain = _NotRebuildable().settings()
    with pytest.raises(ConfigError, match="defines no from_settings"):
        from_settings(plain, {})
    with pytest.raises(ConfigError, match=r"cannot import nowhere\.at_all:Sink"):
        from_settings({**plain, "class": "nowhere.at_all:Sink"}, {})
    with pytest.raises(ConfigError, match="is not a sink class"):
        from_settings({**plain, "class": "json:dumps"}, {})
    with pytest.raises(ConfigError, match="they name no class"):
        from_settings({"kind": "plain", "sink_id": "s"}, {})
