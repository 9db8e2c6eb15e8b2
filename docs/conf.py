"""Sphinx configuration of the documentation site (``docs/``).

Build it strictly, as CI does (``tests/test_docs.py``)::

    .venv/bin/python -m sphinx -W --keep-going -n -b html docs docs/_build/html

Pages are Markdown (MyST); the reference is generated from the docstrings by
autodoc, whose Sphinx roles (``:class:``, ``:func:``) become links. ``-n``
makes every reference that does not resolve a warning, and ``-W`` a failure.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "twophase"
author = "the twophase authors"
copyright = "2026, the twophase authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "twophase"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

nitpicky = True
# Types of the libraries the project uses: their sites are not linked (the
# build runs offline), so references to them are left as text.
nitpick_ignore_regex = [
    (r"py:.*", r"(pyspark|pyarrow|pa|psycopg|kafka|deltalake|prometheus_client|numpy|np)(\..*)?"),
    (r"py:.*", r"(collections\.abc|typing|pathlib|datetime|threading|logging|argparse)\..*"),
    (r"py:.*", r"(os|abc|enum|json|io|subprocess|contextlib|concurrent\.futures)(\..*)?"),
    (r"py:class", r"(str|int|float|bool|bytes|dict|list|tuple|set|object|type|Exception|None)"),
]


# Docstrings of internal modules refer to internal helpers that the site does
# not document one by one ({doc}`reference/internals` shows each module's
# docstring). Such a reference renders as code when its target exists in the
# code; a target that does not exist (renamed, removed, misspelt) stays a
# warning, so the strict build fails on it.
_PACKAGES = ("sinks", "lifecycle")


@functools.cache
def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, name in enumerate(parts[cut:], start=cut):
            if hasattr(obj, name):
                obj = getattr(obj, name)
            else:  # a dataclass field without a default is an annotation only
                return i == len(parts) - 1 and name in getattr(obj, "__annotations__", {})
        return True
    return False


@functools.cache
def _modules() -> tuple[str, ...]:
    """Every module of the packages, found once per build."""
    return tuple(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for root in _PACKAGES
        for path in sorted((ROOT / root).rglob("*.py"))
    )


@functools.cache
def _anywhere(name: str) -> bool:
    """``name`` (``x`` or ``Class.x``) is defined in some module of the packages."""
    return any(_resolve(f"{module}.{name}") for module in _modules())


def _internal_reference(app, env, node, contnode):  # type: ignore[no-untyped-def]
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    module = node.get("py:module") or ""
    cls = node.get("py:class") or ""
    candidates = [target]
    if module:
        candidates.append(f"{module}.{target}")
        if cls:
            candidates.append(f"{module}.{cls}.{target}")
    if not any(c.split(".")[0] in _PACKAGES and _resolve(c) for c in candidates):
        if "." in target and target.split(".")[0] in _PACKAGES:
            return None
        if not _anywhere(target):
            return None
    return contnode


_RAW_ROLE = re.compile(r":(?:class|func|mod|meth|attr|data|exc|obj|doc):(?:`|<code)")


def _no_raw_roles(app, exception):  # type: ignore[no-untyped-def]
    """A role that reached a page as text (inside a literal block, or in
    Markdown where MyST wants ``{role}``) fails the build."""
    if exception is not None or app.builder.format != "html":
        return
    found = []
    for page in sorted(Path(app.outdir).rglob("*.html")):
        if "_sources" in page.parts or "_modules" in page.parts:
            continue
        for n, line in enumerate(page.read_text(errors="replace").splitlines(), 1):
            if _RAW_ROLE.search(line):
                found.append(f"{page.relative_to(app.outdir)}:{n}: {line.strip()[:120]}")
    if found:
        from sphinx.errors import ExtensionError

        raise ExtensionError("raw Sphinx roles in the pages:\n" + "\n".join(found))


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("missing-reference", _internal_reference)
    app.connect("build-finished", _no_raw_roles)
    # Napoleon reads an attribute's docstring "incarnation holding the claim;
    # None: never claimed" as a type and a text; the attributes' docstrings here
    # are plain sentences, so napoleon only sees the others (its Args: sections).
    from sphinx.ext import napoleon

    for listener in list(app.events.listeners["autodoc-process-docstring"]):
        if listener.handler is napoleon._process_docstring:
            app.disconnect(listener.id)

    def _process(app, what, name, obj, options, lines):  # type: ignore[no-untyped-def]
        if what not in ("attribute", "property", "data"):
            napoleon._process_docstring(app, what, name, obj, options, lines)

    app.connect("autodoc-process-docstring", _process)
