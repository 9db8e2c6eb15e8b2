"""Column references Spark cannot misread."""

from __future__ import annotations

from pyspark.sql import Column
from pyspark.sql import functions as F


def column(name: str) -> Column:
    """The top-level column called ``name``, whatever it holds: Spark parses a
    bare name, so ``order.id`` would be a field of a struct ``order``; quoted in
    backticks (a backtick in the name doubled) it is the column itself."""
    return F.col("`" + name.replace("`", "``") + "`")
