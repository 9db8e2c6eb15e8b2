"""``twophase audit``: do the sinks hold what the ledger says each checkpoint committed?

When a checkpoint commits, the ledger keeps, with the checkpoint in its history,
every committed transaction's *evidence* (what :meth:`sinks.capabilities.Audits.evidence`
gives: name, rows, and how to find it again). The history, and so the evidence,
is kept for the last ``Job(audit_checkpoints=...)`` checkpoints (50 by default).
:func:`audit` rebuilds each sink from the settings the ledger recorded and asks
it (:meth:`sinks.capabilities.Audits.audit`) to check that evidence against its own
records: PostgreSQL commit-marker rows, Kafka COMMIT markers at the offsets the
records got, Delta versions with their app transaction, files and
``numRecords`` (see :mod:`sinks.audit`).

It checks evidence, not contents (retention, compaction, VACUUM and upserts
change contents legitimately). ``expired`` (the sink no longer keeps the
record) is told apart from ``mismatch``; a checkpoint older than the ledger's
window, or committed by a version that kept no evidence, cannot be audited and
says so. Only a mismatch fails an audit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lifecycle._table import aligned, local_time
from sinks import capabilities
from sinks.audit import CheckpointEvidence, Finding, Verdict
from sinks.base import JobScope, Sink

DEFAULT_LAST = 20
"""checkpoints an audit checks by default: the newest ones"""

_WORST = (Verdict.MISMATCH, Verdict.EXPIRED, Verdict.UNVERIFIABLE, Verdict.OK)


@dataclass
class SinkCheck:
    """The audit of one sink in one checkpoint."""

    checkpoint: int
    kind: str
    committed_at: float
    sink: str  # pipeline/sink_id
    findings: list[Finding] = field(default_factory=list)
    note: str = ""

    @property
    def verdict(self) -> Verdict:
        if not self.findings:
            return Verdict.UNVERIFIABLE
        seen = {f.verdict for f in self.findings}
        return next(v for v in _WORST if v in seen)

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.findings)


@dataclass
class AuditReport:
    """Everything an audit found."""

    job: str
    incarnation: str | None
    checks: list[SinkCheck]
    kept: list[int]
    """ids of the checkpoints whose evidence the ledger keeps"""
    older: int
    """checkpoints committed before the window (their evidence is gone from the ledger)"""
    unreadable: dict[str, str] = field(default_factory=dict)
    """sinks the audit could not read (label -> why)"""

    @property
    def mismatches(self) -> list[tuple[SinkCheck, Finding]]:
        return [(c, f) for c in self.checks for f in c.findings if f.verdict is Verdict.MISMATCH]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "twophase.audit/1",
            "job": self.job,
            "incarnation": self.incarnation,
            "ok": self.ok,
            "kept_checkpoints": self.kept,
            "older_checkpoints": self.older,
            "unreadable": self.unreadable,
            "checks": [
                {
                    "checkpoint": c.checkpoint,
                    "kind": c.kind,
                    "committed_at": c.committed_at,
                    "sink": c.sink,
                    "verdict": c.verdict.value,
                    "rows": c.rows,
                    "note": c.note,
                    "findings": [
                        {
                            "txn": f.txn,
                            "verdict": f.verdict.value,
                            "rows": f.rows,
                            "detail": f.detail,
                        }
                        for f in c.findings
                    ],
                }
                for c in self.checks
            ],
        }


def audit(
    doc: Mapping[str, Any], sinks: Mapping[str, Mapping[str, Sink]], last: int | None = DEFAULT_LAST
) -> AuditReport:
    """Audit the ``last`` newest checkpoints of ledger document ``doc`` (None: every
    one the ledger keeps) with ``sinks`` (pipeline -> sink id -> sink)."""
    history = list(doc.get("history") or [])
    kept = [int(cp["id"]) for cp in history]
    first_kept = kept[0] if kept else int(doc.get("next_checkpoint", 1))
    older = max(0, first_kept - 1)
    chosen = history if last is None else history[-last:] if last > 0 else []
    checks: list[SinkCheck] = []
    report_unreadable: dict[str, str] = {}
    per_sink: dict[str, list[tuple[SinkCheck, CheckpointEvidence]]] = {}
    for cp in chosen:
        evidence = cp.get("evidence")
        labels = sorted(set(cp.get("rows") or {}) | set(evidence or {}))
        for label in labels:
            check = SinkCheck(int(cp["id"]), cp["kind"], float(cp.get("committed_at") or 0), label)
            checks.append(check)
            committed = (evidence or {}).get(label)
            if committed is None:
                rows = int((cp.get("rows") or {}).get(label, 0))
                check.note = (
                    "no evidence kept (committed by a version that kept none)"
                    if rows
                    else "nothing committed"
                )
                if not rows:
                    check.findings.append(Finding(check.checkpoint, "-", Verdict.OK, "", 0))
                continue
            if not committed:
                check.findings.append(Finding(check.checkpoint, "-", Verdict.OK, "no rows", 0))
                continue
            per_sink.setdefault(label, []).append(
                (check, CheckpointEvidence(check.checkpoint, check.committed_at, committed))
            )
    for label, items in per_sink.items():
        pipeline, _, sid = label.partition("/")
        sink = (sinks.get(pipeline) or {}).get(sid)
        if sink is None:
            for check, _ev in items:
                check.note = "the ledger records no settings for this sink"
            continue
        scope = JobScope(doc["job"], pipeline, sid, doc.get("incarnation"))
        try:
            findings = capabilities.audit(sink.committer(), scope, [ev for _c, ev in items])
        except Exception as e:  # the sink cannot be read: every check says why
            report_unreadable[label] = f"{type(e).__name__}: {e}"
            for check, ev in items:
                check.findings.extend(
                    Finding(
                        ev.checkpoint,
                        str(c["txn"]),
                        Verdict.UNVERIFIABLE,
                        f"cannot read: {e}",
                        int(c.get("rows", 0)),
                    )
                    for c in ev.committed
                )
            continue
        by_cp: dict[int, list[Finding]] = {}
        for f in findings:
            by_cp.setdefault(f.checkpoint, []).append(f)
        for check, _ev in items:
            check.findings.extend(by_cp.get(check.checkpoint, []))
    checks.sort(key=lambda c: (c.checkpoint, c.sink))
    return AuditReport(doc["job"], doc.get("incarnation"), checks, kept, older, report_unreadable)


def format_report(report: AuditReport) -> str:
    """The audit as a table, then every mismatch by name."""
    kept = (
        f"checkpoints #{report.kept[0]}..#{report.kept[-1]} kept"
        if report.kept
        else "no checkpoint kept"
    )
    out = [
        f"audit of job {report.job}  incarnation {report.incarnation or '-'}: {kept}"
        + (f", {report.older} older one(s) beyond the window" if report.older else "")
    ]
    rows = [("checkpoint", "kind", "committed", "sink", "txns", "rows", "verdict")]
    for c in report.checks:
        txns = sum(1 for f in c.findings if f.txn != "-")
        verdict = c.verdict.value + (f" ({c.note})" if c.note else "")
        rows.append(
            (
                f"#{c.checkpoint}",
                c.kind,
                local_time(c.committed_at),
                c.sink,
                str(txns),
                f"{c.rows:,}",
                verdict.upper() if c.verdict is Verdict.MISMATCH else verdict,
            )
        )
    if len(rows) == 1:
        out.append("  nothing to audit")
    else:
        out.extend(aligned(rows))
    counts: dict[str, int] = {}
    for c in report.checks:
        for f in c.findings:
            if f.txn != "-":
                counts[f.verdict.value] = counts.get(f.verdict.value, 0) + 1
    out.append(
        "transactions: " + (", ".join(f"{n} {v}" for v, n in sorted(counts.items())) or "none")
    )
    for c, f in report.mismatches:
        out.append(f"MISMATCH checkpoint #{c.checkpoint} {c.sink} {f.txn}: {f.detail}")
    for label, why in sorted(report.unreadable.items()):
        out.append(f"UNREADABLE {label}: {why}")
    expired = [(c, f) for c in report.checks for f in c.findings if f.verdict is Verdict.EXPIRED]
    for c, f in expired[:10]:
        out.append(f"expired  checkpoint #{c.checkpoint} {c.sink} {f.txn}: {f.detail}")
    if len(expired) > 10:
        out.append(f"expired  ... and {len(expired) - 10} more")
    return "\n".join(out)
