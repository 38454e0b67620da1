"""SQLAlchemy models. The schema itself changes only through migrations/.

Telemetry tables are range-partitioned by ``ts`` (one partition a day, see
``partitions.py``), which makes retention a cheap ``DROP TABLE`` of old days.
Partitioned tables cannot carry a primary key without the partition key, so
the mapped primary keys below are for the ORM's identity map only.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, Float, Integer, SmallInteger, Text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    hostname: Mapped[str] = mapped_column(Text)
    address: Mapped[str] = mapped_column(Text)
    probe_port: Mapped[int] = mapped_column(Integer)
    rack: Mapped[str | None] = mapped_column(Text)
    pod: Mapped[str | None] = mapped_column(Text)
    gpu_count: Mapped[int] = mapped_column(SmallInteger)
    labels: Mapped[dict[str, Any]] = mapped_column(JSONB)
    state: Mapped[str] = mapped_column(Text)  # active | isolated
    token_hash: Mapped[str] = mapped_column(Text)
    registered_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_seen: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_seq: Mapped[int | None] = mapped_column(BigInteger)


class ApiToken(Base):
    """Tokens for people and schedulers; node tokens live on ``nodes``."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(Text)
    role: Mapped[str] = mapped_column(Text)  # admin | read | isolate
    token_hash: Mapped[str] = mapped_column(Text, unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class IngestBatch(Base):
    """The ingest ledger: one row per accepted (node, seq)."""

    __tablename__ = "ingest_batches"

    node: Mapped[str] = mapped_column(Text, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    received_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    rows: Mapped[int] = mapped_column(Integer)


class ProbeStatRow(Base):
    __tablename__ = "probe_stats"

    ts: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    src: Mapped[str] = mapped_column(Text, primary_key=True)
    dst: Mapped[str] = mapped_column(Text, primary_key=True)
    flow: Mapped[int] = mapped_column(Integer, primary_key=True)
    sent: Mapped[int] = mapped_column(Integer)
    received: Mapped[int] = mapped_column(Integer)
    rtt_min_us: Mapped[float | None] = mapped_column(Float)
    rtt_p50_us: Mapped[float | None] = mapped_column(Float)
    rtt_max_us: Mapped[float | None] = mapped_column(Float)


class HostSampleRow(Base):
    __tablename__ = "host_samples"

    ts: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    node: Mapped[str] = mapped_column(Text, primary_key=True)
    cpu_pct: Mapped[float] = mapped_column(Float)
    load1: Mapped[float] = mapped_column(Float)
    mem_total_bytes: Mapped[int] = mapped_column(BigInteger)
    mem_available_bytes: Mapped[int] = mapped_column(BigInteger)


class GpuSampleRow(Base):
    __tablename__ = "gpu_samples"

    ts: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    node: Mapped[str] = mapped_column(Text, primary_key=True)
    gpu: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    uuid: Mapped[str | None] = mapped_column(Text)
    pci_bus_id: Mapped[str | None] = mapped_column(Text)
    util_pct: Mapped[float | None] = mapped_column(Float)
    mem_used_bytes: Mapped[int | None] = mapped_column(BigInteger)
    temp_c: Mapped[float | None] = mapped_column(Float)
    power_w: Mapped[float | None] = mapped_column(Float)
    sm_clock_mhz: Mapped[float | None] = mapped_column(Float)
    throttle_reasons: Mapped[int | None] = mapped_column(BigInteger)
    ecc_volatile_sbe: Mapped[int | None] = mapped_column(BigInteger)
    ecc_volatile_dbe: Mapped[int | None] = mapped_column(BigInteger)
    ecc_aggregate_sbe: Mapped[int | None] = mapped_column(BigInteger)
    ecc_aggregate_dbe: Mapped[int | None] = mapped_column(BigInteger)
    retired_pages: Mapped[int | None] = mapped_column(BigInteger)
    remapped_rows_pending: Mapped[int | None] = mapped_column(BigInteger)
    remapped_rows_failed: Mapped[int | None] = mapped_column(BigInteger)
    pcie_replay: Mapped[int | None] = mapped_column(BigInteger)
    nvlink_errors: Mapped[int | None] = mapped_column(BigInteger)


class NicCounterRow(Base):
    __tablename__ = "nic_counters"

    ts: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    node: Mapped[str] = mapped_column(Text, primary_key=True)
    iface: Mapped[str] = mapped_column(Text, primary_key=True)
    counter: Mapped[str] = mapped_column(Text, primary_key=True)
    value: Mapped[float] = mapped_column(Float)
    rate: Mapped[float | None] = mapped_column(Float)


class EventRow(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    ts: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    node: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(Text)
    severity: Mapped[str] = mapped_column(Text)
    job: Mapped[str | None] = mapped_column(Text)
    rank: Mapped[int | None] = mapped_column(Integer)
    message: Mapped[str] = mapped_column(Text)
    attrs: Mapped[dict[str, Any]] = mapped_column(JSONB)
    received_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


# Telemetry tables and the columns COPY writes, in order; one source of truth
# for the migration's partition management and for ingest.
PARTITIONED_TABLES = ("probe_stats", "host_samples", "gpu_samples", "nic_counters", "events")
