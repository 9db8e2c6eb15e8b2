"""Files with one job: no product module past about 450 lines unless its
module docstring says why (a sentence beginning "Longer than 450 lines
because"), and every module listed in the site's map of modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 460
REASON = "Longer than 450 lines because"


def _modules() -> list[Path]:
    return sorted(
        p
        for root in ("sinks", "lifecycle")
        for p in (ROOT / root).rglob("*.py")
        if "__pycache__" not in p.parts
    )


def test_a_long_module_says_why() -> None:
    unexplained = []
    for path in _modules():
        lines = path.read_text().count("\n")
        if lines > LIMIT:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            if REASON not in doc:
                unexplained.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not unexplained, (
        f"split these along their seams, or say in the module docstring '{REASON} ...': "
        + ", ".join(unexplained)
    )


def test_the_map_of_modules_lists_every_module() -> None:
    page = (ROOT / "docs" / "reference" / "internals.md").read_text()
    page += (ROOT / "docs" / "reference" / "api.md").read_text()  # the public ones
    elsewhere = {
        "lifecycle.errors",
        "sinks.errors",
        "lifecycle.testing",
        "lifecycle.testing.plugin",
    }
    missing = []
    for path in _modules():
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if name not in elsewhere and f".. automodule:: {name}\n" not in page:
            missing.append(name)
    assert not missing, f"docs/reference/internals.md lacks: {', '.join(missing)}"


def test_every_public_name_has_a_docstring() -> None:
    """What the API reference renders: every name the packages export, and the
    public methods and properties of their classes."""
    import inspect

    import lifecycle
    import lifecycle.testing
    import sinks

    missing = []
    for module in (lifecycle, sinks, lifecycle.testing):
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.getdoc(obj) or "").strip():
                missing.append(f"{module.__name__}.{name}")
            if inspect.isclass(obj):
                for member, value in vars(obj).items():
                    documentable = callable(value) or isinstance(value, property)
                    if member.startswith("_") or not documentable:
                        continue
                    if not (inspect.getdoc(value) or "").strip():
                        missing.append(f"{module.__name__}.{name}.{member}")
    assert not missing, f"no docstring: {', '.join(missing)}"
