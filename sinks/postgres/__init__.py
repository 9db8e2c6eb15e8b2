"""PostgreSQL sink: binary COPY in prepared transactions, ``COMMIT PREPARED`` by the driver."""

from sinks.postgres.sink import PostgresSink

__all__ = ["PostgresSink"]
