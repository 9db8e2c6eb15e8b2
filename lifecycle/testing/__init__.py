"""The test kit: test your own job exactly-once against real services.

``pip install 'twophase[testing]'`` brings the embedded Kafka broker (tansu)
and registers the pytest plugin (:mod:`lifecycle.testing.plugin`: fixtures
``twophase_postgres``, ``twophase_pg_dsn``, ``twophase_kafka``,
``twophase_kafka_topic``, ``twophase_delta_table``, ``twophase_spark``).

* :mod:`lifecycle.testing.verify`: ``assert_exactly_once_postgres/kafka/delta``
  and ``assert_final_state_postgres/kafka/delta``, which also assert nothing is
  left prepared, open or staged;
* :mod:`lifecycle.testing.crash`: ``crash_test(job, kills=N, seed=...)``;
* :mod:`lifecycle.testing.postgres_server`, :mod:`lifecycle.testing.kafka_broker`:
  the embedded services, also runnable as programs;
* :mod:`lifecycle.testing.apache_kafka`: ``ApacheKafka``, the broker users run
  (from jars :mod:`lifecycle.testing.jars` fetches), with
  :mod:`lifecycle.testing.kafka_security`'s ``SecureListener`` for SASL_SSL
  and ACLs;
* :mod:`lifecycle.testing.hdfs`: ``MiniHdfs``, a NameNode and a DataNode
  (Hadoop's minicluster, from jars too) for a ``state_dir`` on ``hdfs://``.

Names are imported lazily (this package is imported with the plugin in every
pytest run; Spark, psycopg and the clients load only when used).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "assert_exactly_once_postgres": "verify",
    "assert_exactly_once_kafka": "verify",
    "assert_exactly_once_delta": "verify",
    "assert_final_state_postgres": "verify",
    "assert_final_state_kafka": "verify",
    "assert_final_state_delta": "verify",
    "assert_nothing_left_postgres": "verify",
    "assert_nothing_left_kafka": "verify",
    "assert_nothing_left_delta": "verify",
    "crash_test": "crash",
    "CrashReport": "crash",
    "CrashTestError": "crash",
    "PostgresServer": "postgres_server",
    "KafkaBroker": "kafka_broker",
    "ApacheKafka": "apache_kafka",
    "SecureListener": "kafka_security",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
