"""The event topic and its dead-letter topic on a Kafka-protocol cluster: names, client settings
and creation. confluent-kafka is imported here lazily, so a CLI installed without the `kafka`
extra still starts (and says what is missing when a Kafka command runs)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

DEFAULT_TOPIC = "tollgate.events"
DEFAULT_PARTITIONS = 8


class KafkaSettingError(ValueError):
    """A `TOLLGATE_KAFKA_<SETTING>` value the chosen client cannot take."""


def dead_letter_topic(topic: str) -> str:
    return f"{topic}.dead-letters"


def group_for(topic: str) -> str:
    """The folds' consumer group: one per event topic (two deployments sharing a cluster, or
    two test runs sharing a broker, never share members)."""
    return f"{topic}.folds"


def confluent() -> Any:
    try:
        import confluent_kafka
    except ImportError as exc:  # pragma: no cover - the plain install
        raise RuntimeError(
            "the distributed mode needs confluent-kafka: pip install 'tollgate-llm[kafka]'"
        ) from exc
    return confluent_kafka


def client_settings(
    bootstrap: str,
    extra: Mapping[str, Any] | None = None,
    *,
    kafka_settings: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """librdkafka settings: the bootstrap servers, then the configured `kafka_settings`
    (`TOLLGATE_KAFKA_SECURITY_PROTOCOL=SASL_SSL` or the file's [kafka] table, read once at start
    by api/config.py), then `extra`. This is how a production cluster's TLS/SASL settings
    arrive with no code change."""
    return {"bootstrap.servers": bootstrap, **(kafka_settings or {}), **(extra or {})}


def ensure_topic(
    bootstrap: str, topic: str, partitions: int = DEFAULT_PARTITIONS,
    *, kafka_settings: Mapping[str, str] | None = None,
) -> bool:  # fmt: skip
    """Create `topic` (and its dead-letter topic) if missing; True if this call created the
    event topic (not when another client's creation came first)."""
    ck = confluent()
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(client_settings(bootstrap, kafka_settings=kafka_settings))
    present = set(admin.list_topics(timeout=10).topics)
    wanted = [t for t in (topic, dead_letter_topic(topic)) if t not in present]
    created = False
    if wanted:
        futures = admin.create_topics([NewTopic(t, partitions, 1) for t in wanted])
        for name, future in futures.items():
            try:
                future.result(10)
                created = created or name == topic
            except ck.KafkaException as exc:
                if exc.args[0].code() != ck.KafkaError.TOPIC_ALREADY_EXISTS:
                    raise RuntimeError(f"could not create topic {name}: {exc}") from exc
    return created


def partition_count(
    bootstrap: str, topic: str, *, kafka_settings: Mapping[str, str] | None = None
) -> int | None:
    """The topic's partition count, None if the cluster does not have it."""
    confluent()
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(client_settings(bootstrap, kafka_settings=kafka_settings))
    metadata = admin.list_topics(topic, timeout=10)
    found = metadata.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        return None
    return len(found.partitions)


def replace_topic(
    bootstrap: str, topic: str, partitions: int, timeout_s: float = 30.0,
    *, kafka_settings: Mapping[str, str] | None = None,
) -> None:  # fmt: skip
    """Delete `topic` and create it again with `partitions` (the relay's own count), for a topic
    that another client created behind the relay's back after a broker loss. A deletion can take
    a moment to finish on a real cluster: the creation is retried until it does."""
    ck = confluent()
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(client_settings(bootstrap, kafka_settings=kafka_settings))
    for future in admin.delete_topics([topic], operation_timeout=timeout_s).values():
        try:
            future.result(timeout_s)
        except ck.KafkaException as exc:
            if exc.args[0].code() != ck.KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise RuntimeError(f"could not delete topic {topic}: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    while True:
        future = admin.create_topics([NewTopic(topic, partitions, 1)])[topic]
        try:
            future.result(timeout_s)
            return
        except ck.KafkaException as exc:
            if exc.args[0].code() != ck.KafkaError.TOPIC_ALREADY_EXISTS:
                raise RuntimeError(f"could not create topic {topic}: {exc}") from exc
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {topic} is still being deleted") from exc
            time.sleep(0.2)
