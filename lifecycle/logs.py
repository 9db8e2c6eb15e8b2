"""The logging switch for job scripts: readable by default, chatty when asked.

The library only logs (loggers ``lifecycle.*`` and ``sinks.*``); it never
configures logging on import. At INFO it says one line per checkpoint and per
lifecycle transition (a pipeline starts, consumes its input, finishes its logic;
a stop; recovery work); per-transaction detail is at DEBUG; failures are one
ERROR record with the full trace.

A job script may call :func:`configure_logging` once, at start::

    from lifecycle import configure_logging
    configure_logging()                     # or configure_logging("DEBUG", spark=spark)

Environment switches, read when it is called (arguments win):

* ``TWOPHASE_LOG_LEVEL`` (default ``INFO``): level of ``lifecycle.*`` and ``sinks.*``.
* ``TWOPHASE_VERBOSE=1``: also let the clients talk: py4j's and kafka-python's
  loggers at that level (else WARNING: py4j logs every callback at INFO, and
  kafka-python every connection), and Spark's JVM log at INFO (else WARN).
"""

from __future__ import annotations

import logging
import os
import sys

from pyspark.sql import SparkSession

LEVEL_ENV = "TWOPHASE_LOG_LEVEL"
VERBOSE_ENV = "TWOPHASE_VERBOSE"
OURS = ("lifecycle", "sinks")
CLIENTS = ("py4j", "kafka")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def configure_logging(
    level: int | str | None = None,
    *,
    verbose_clients: bool | None = None,
    spark: SparkSession | None = None,
    spark_level: str | None = None,
) -> None:
    """Set up logging for a job script (call once; the library never does this itself).

    Args:
        level: level of the library's loggers (``lifecycle``, ``sinks``); default
            ``$TWOPHASE_LOG_LEVEL`` or INFO.
        verbose_clients: let py4j and kafka-python log at ``level`` too; default
            ``$TWOPHASE_VERBOSE``. Off: they log WARNING and above only.
        spark: when given, Spark's JVM log level is set too (``setLogLevel``).
        spark_level: that level; default INFO when verbose, else WARN (what a
            plain ``python job.py`` gets; ``spark-submit`` defaults to INFO).

    When the root logger has no handler yet, one writing to stderr is added
    (root level WARNING, so other libraries stay quiet); an existing logging
    setup is kept, only the levels above are set.
    """
    if level is None:
        level = os.environ.get(LEVEL_ENV, "INFO")
    if isinstance(level, str):
        level = logging.getLevelName(level.strip().upper())
        if not isinstance(level, int):
            raise ValueError(f"unknown log level in {LEVEL_ENV} or level=: {level!r}")
    if verbose_clients is None:
        verbose_clients = _truthy(os.environ.get(VERBOSE_ENV))
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
    for name in OURS:
        logging.getLogger(name).setLevel(level)
    for name in CLIENTS:
        logging.getLogger(name).setLevel(level if verbose_clients else logging.WARNING)
    if spark is not None:
        spark.sparkContext.setLogLevel(spark_level or ("INFO" if verbose_clients else "WARN"))
