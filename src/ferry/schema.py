"""The one message schema every connector and job uses (Spark and Arrow).

| column       | type                | meaning                                                    |
|--------------|---------------------|------------------------------------------------------------|
| subject      | string              | NATS subject, or AMQP routing key                          |
| payload      | binary              | the message body, bytes as they were                       |
| headers      | map<string,string>  | NATS headers; AMQP headers rendered as text                |
| msg_id       | string              | Nats-Msg-Id or AMQP message_id, when present               |
| source       | string              | where it was read: ``east/ORDERS``, ``ltm/%2F/orders``     |
| source_seq   | bigint              | stream sequence; for a queue, the read order               |
| timestamp    | timestamp (UTC)     | stream time, or the AMQP timestamp property                |
| properties   | struct (nullable)   | AMQP basic properties; ``headers`` there is typed JSON     |
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pyarrow as pa

__all__ = ["ARROW_SCHEMA", "BACKUP_RECORD", "PROPERTY_FIELDS", "SPARK_DDL", "BatchBuilder"]

# beside a Parquet backup's files (a name Spark and Arrow skip as they read them): its source
# and, for a stream's, the stream's configuration (`ferry copy parquet://… jetstream://… --create`)
BACKUP_RECORD = "_ferry_backup.json"

PROPERTY_FIELDS = [
    ("content_type", pa.string()),
    ("content_encoding", pa.string()),
    ("delivery_mode", pa.int32()),
    ("priority", pa.int32()),
    ("correlation_id", pa.string()),
    ("reply_to", pa.string()),
    ("expiration", pa.string()),
    ("message_id", pa.string()),
    ("timestamp", pa.timestamp("us", tz="UTC")),
    ("type", pa.string()),
    ("user_id", pa.string()),
    ("app_id", pa.string()),
    ("headers", pa.string()),  # typed JSON of the AMQP headers table (exact round trip)
]

ARROW_SCHEMA = pa.schema(
    [
        ("subject", pa.string()),
        ("payload", pa.binary()),
        ("headers", pa.map_(pa.string(), pa.string())),
        ("msg_id", pa.string()),
        ("source", pa.string()),
        ("source_seq", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("properties", pa.struct(PROPERTY_FIELDS)),
    ]
)

_SPARK_TYPES = {
    pa.string(): "string",
    pa.binary(): "binary",
    pa.int32(): "int",
    pa.int64(): "bigint",
    pa.timestamp("us", tz="UTC"): "timestamp",
}
_PROPS_DDL = ",".join(f"{name}:{_SPARK_TYPES[t]}" for name, t in PROPERTY_FIELDS)
SPARK_DDL = (
    "subject string, payload binary, headers map<string,string>, msg_id string, source string, "
    f"source_seq bigint, timestamp timestamp, properties struct<{_PROPS_DDL}>"
)


class BatchBuilder:
    """Accumulates messages column by column and emits Arrow record batches."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.cols: dict[str, list[Any]] = {f.name: [] for f in ARROW_SCHEMA}

    def __len__(self) -> int:
        return len(self.cols["subject"])

    def add(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, str] | None,
        msg_id: str | None,
        source: str,
        source_seq: int,
        timestamp: datetime | None,
        properties: dict[str, Any] | None = None,
    ) -> None:
        c = self.cols
        c["subject"].append(subject)
        c["payload"].append(payload)
        c["headers"].append(list(headers.items()) if headers else None)
        c["msg_id"].append(msg_id)
        c["source"].append(source)
        c["source_seq"].append(source_seq)
        c["timestamp"].append(timestamp)
        c["properties"].append(properties)

    def flush(self) -> pa.RecordBatch:
        batch = pa.RecordBatch.from_pydict(self.cols, schema=ARROW_SCHEMA)
        self.clear()
        return batch
