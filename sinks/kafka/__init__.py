"""Kafka sink: one transaction per task attempt, resumed and committed by the driver."""

from sinks.kafka.sink import KafkaSink

__all__ = ["KafkaSink"]
