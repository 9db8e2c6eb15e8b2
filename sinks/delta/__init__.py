"""Delta Lake sink: Parquet files staged by executors, committed by the driver as
one Delta version per checkpoint (see :mod:`sinks.delta.sink`)."""

from sinks.delta.layout import DeltaSchemaError
from sinks.delta.sink import DeltaSink

__all__ = ["DeltaSchemaError", "DeltaSink"]
