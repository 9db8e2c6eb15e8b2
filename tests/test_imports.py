"""The shape of the imports (grimp reads every import statement of the two
packages, those inside functions too).

* No import circle between modules. Imports under ``if TYPE_CHECKING:`` are
  left out: they never run, and annotations may name a module that imports
  this one.
* ``sinks`` never imports ``lifecycle``: the sinks know nothing of jobs.
* An executor-side writer never imports its driver-side sink, not even through
  other modules: the sink hands the writer what it needs when it opens it.
* ``lifecycle`` reaches the sinks only through the protocol's interfaces
  (:mod:`sinks.base`, :mod:`sinks.committer`, :mod:`sinks.capabilities`) and
  the vocabulary they share (scopes, names, progress, errors): never a sink's
  own modules. The test kit (``lifecycle.testing``) checks real targets and
  may read them; ``sinks.rebuild`` builds the sinks a ledger names.
"""

from __future__ import annotations

import sys

import grimp
import pytest

PACKAGES = ("sinks", "lifecycle")
WRITERS = {
    "sinks.postgres.writer": "sinks.postgres.sink",
    "sinks.kafka.writer": "sinks.kafka.sink",
    "sinks.delta.writer": "sinks.delta.sink",
}


PROTOCOL = {
    "sinks.base",
    "sinks.committer",
    "sinks.capabilities",
    "sinks.scope",
    # the vocabulary the protocol speaks in
    "sinks.audit",
    "sinks.errors",
    "sinks.naming",
    "sinks.progress",
    "sinks.explain",
    "sinks.versions",
    # shared helpers of the two packages, no sink's
    "sinks._faults",
    "sinks._parallel",
    "sinks._retry",
    # the factory the `twophase` commands rebuild recorded sinks with
    "sinks.rebuild",
    # the ledger in PostgreSQL keeps its connections alive as the sink does
    "sinks.postgres.liveness",
    # and checks its role's privileges as the sink does
    "sinks.postgres.grants",
}
"""every module of ``sinks`` that ``lifecycle`` (outside its test kit) may import"""


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges)))
    try:
        for module in edges:
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return found


def _describe(graph: grimp.ImportGraph, group: list[str]) -> str:
    lines = []
    for a in group:
        for b in sorted(graph.find_modules_directly_imported_by(a)):
            if b in group:
                at = [d["line_number"] for d in graph.get_import_details(importer=a, imported=b)]
                lines.append(f"  {a} imports {b} (line {', '.join(map(str, at))})")
    return "\n".join(lines)


def test_no_import_circle(graph: grimp.ImportGraph) -> None:
    found = circles(graph)
    assert not found, "import circles:\n" + "\n\n".join(_describe(graph, g) for g in found)


def test_the_circle_finder_finds_a_circle() -> None:
    g = grimp.ImportGraph()
    for m in ("a", "b", "c"):
        g.add_module(m)
    g.add_import(importer="a", imported="b")
    g.add_import(importer="b", imported="c")
    assert circles(g) == []
    g.add_import(importer="c", imported="a")
    assert circles(g) == [["a", "b", "c"]]


def test_the_sinks_never_import_the_lifecycle(graph: grimp.ImportGraph) -> None:
    chain = graph.find_shortest_chain(importer="sinks", imported="lifecycle", as_packages=True)
    assert chain is None, f"sinks imports lifecycle: {' -> '.join(chain or ())}"


@pytest.mark.parametrize("writer,sink", sorted(WRITERS.items()))
def test_a_writer_never_imports_its_sink(graph: grimp.ImportGraph, writer: str, sink: str) -> None:
    assert writer in graph.modules, f"{writer} is gone: update WRITERS"
    chain = graph.find_shortest_chain(importer=writer, imported=sink)
    assert chain is None, f"{' -> '.join(chain or ())}"


def test_the_lifecycle_reaches_sinks_only_through_the_protocol() -> None:
    graph = grimp.build_graph(*PACKAGES)  # imports for type checking too
    found = [
        f"{m} imports {t} (line "
        + ", ".join(str(d["line_number"]) for d in graph.get_import_details(importer=m, imported=t))
        + ")"
        for m in sorted(graph.modules)
        if m.startswith("lifecycle") and not m.startswith("lifecycle.testing")
        for t in sorted(graph.find_modules_directly_imported_by(m))
        if t.startswith("sinks.") and t not in PROTOCOL
    ]
    assert not found, "\n".join(found)
