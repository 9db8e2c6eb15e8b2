"""The slow tier: cases of the long crash matrices that the default run leaves
out (``-m slow`` runs them; ``.ci/run`` keeps to the default run's 45 minutes).

The default run keeps at least one case of every crash test, chosen so that
each commit phase is killed for some sink; the slow tier holds the rest of each
matrix, the single-sink keyed models under kills (the three-sink one stays),
the second case of two-case crash tests (a task that raises after it prepared:
the one whose worker is killed stays), the phases of a sink's crash matrix that
another sink's default cases kill, the restart tests' cases on tansu (Apache
Kafka's stay), and crash tests whose path a faster test of the default run
covers (named at each: among them a broker killed while executors write or
while the driver commits, staged Delta files a VACUUM removed, the ACL-exact
secured job, the upsert of the PostgreSQL secured tests, two Delta writers racing
on S3, and the kit's sample project).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest

SLOW = pytest.mark.slow


def params(ids: Iterable[str], keep: Sequence[str]) -> list[Any]:
    """One ``pytest.param`` per id (the value is the id), those not in ``keep``
    in the slow tier."""
    return [pytest.param(i, id=i, marks=() if i in keep else SLOW) for i in ids]
