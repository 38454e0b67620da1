"""Nodes, tokens, ingest ledger and the time-partitioned telemetry tables.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _script(sql: str) -> None:
    # asyncpg prepares each statement: one at a time.
    for statement in sql.split(";"):
        if statement.strip():
            op.execute(statement)


def upgrade() -> None:
    _script(
        """
        CREATE TABLE nodes (
            id            text PRIMARY KEY,
            hostname      text NOT NULL,
            address       text NOT NULL,
            probe_port    integer NOT NULL,
            rack          text,
            pod           text,
            gpu_count     smallint NOT NULL DEFAULT 0,
            labels        jsonb NOT NULL DEFAULT '{}',
            state         text NOT NULL DEFAULT 'active',
            token_hash    text NOT NULL,
            registered_at timestamptz NOT NULL DEFAULT now(),
            last_seen     timestamptz,
            last_seq      bigint
        );
        CREATE UNIQUE INDEX nodes_token_hash ON nodes (token_hash);

        CREATE TABLE api_tokens (
            id         serial PRIMARY KEY,
            name       text NOT NULL,
            role       text NOT NULL CHECK (role IN ('admin', 'read', 'isolate')),
            token_hash text NOT NULL UNIQUE,
            created_at timestamptz NOT NULL DEFAULT now()
        );

        CREATE TABLE ingest_batches (
            node        text NOT NULL,
            seq         bigint NOT NULL,
            received_at timestamptz NOT NULL DEFAULT now(),
            rows        integer NOT NULL,
            PRIMARY KEY (node, seq)
        );
        CREATE INDEX ingest_batches_received_at ON ingest_batches (received_at);

        CREATE TABLE probe_stats (
            ts         timestamptz NOT NULL,
            src        text NOT NULL,
            dst        text NOT NULL,
            flow       integer NOT NULL,
            sent       integer NOT NULL,
            received   integer NOT NULL,
            rtt_min_us double precision,
            rtt_p50_us double precision,
            rtt_max_us double precision
        ) PARTITION BY RANGE (ts);
        CREATE INDEX ON probe_stats (ts);
        CREATE INDEX ON probe_stats (dst, ts);

        CREATE TABLE host_samples (
            ts                  timestamptz NOT NULL,
            node                text NOT NULL,
            cpu_pct             double precision NOT NULL,
            load1               double precision NOT NULL,
            mem_total_bytes     bigint NOT NULL,
            mem_available_bytes bigint NOT NULL
        ) PARTITION BY RANGE (ts);
        CREATE INDEX ON host_samples (node, ts);

        CREATE TABLE gpu_samples (
            ts                    timestamptz NOT NULL,
            node                  text NOT NULL,
            gpu                   smallint NOT NULL,
            uuid                  text,
            pci_bus_id            text,
            util_pct              double precision,
            mem_used_bytes        bigint,
            temp_c                double precision,
            power_w               double precision,
            sm_clock_mhz          double precision,
            throttle_reasons      bigint,
            ecc_volatile_sbe      bigint,
            ecc_volatile_dbe      bigint,
            ecc_aggregate_sbe     bigint,
            ecc_aggregate_dbe     bigint,
            retired_pages         bigint,
            remapped_rows_pending bigint,
            remapped_rows_failed  bigint,
            pcie_replay           bigint,
            nvlink_errors         bigint
        ) PARTITION BY RANGE (ts);
        CREATE INDEX ON gpu_samples (node, ts);

        CREATE TABLE nic_counters (
            ts      timestamptz NOT NULL,
            node    text NOT NULL,
            iface   text NOT NULL,
            counter text NOT NULL,
            value   double precision NOT NULL,
            rate    double precision
        ) PARTITION BY RANGE (ts);
        CREATE INDEX ON nic_counters (ts);
        CREATE INDEX ON nic_counters (node, ts);

        CREATE TABLE events (
            id          bigint GENERATED ALWAYS AS IDENTITY,
            ts          timestamptz NOT NULL,
            node        text NOT NULL,
            kind        text NOT NULL,
            severity    text NOT NULL,
            job         text,
            rank        integer,
            message     text NOT NULL DEFAULT '',
            attrs       jsonb NOT NULL DEFAULT '{}',
            received_at timestamptz NOT NULL DEFAULT now()
        ) PARTITION BY RANGE (ts);
        CREATE INDEX ON events (ts);
        CREATE INDEX ON events (received_at);
        CREATE INDEX ON events (kind, ts);
        """
    )


def downgrade() -> None:
    op.execute(
        "DROP TABLE events, nic_counters, gpu_samples, host_samples, probe_stats,"
        " ingest_batches, api_tokens, nodes"
    )
