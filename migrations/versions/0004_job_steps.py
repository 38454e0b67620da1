"""Per-rank step times of training jobs, for passive straggler detection.

A plain table, not partitioned like the telemetry tables: a job's steps are
few next to probes and samples (one row per rank per step), and they belong
to a job, whose deletion takes them along. Retention is a DELETE by
``received_at`` (the straggler detector prunes rows older than the
retention period, a bounded batch at a time), which the ``received_at``
index keeps cheap; the same index serves the detector's watermark reads.
``(job, rank, step)`` is the key, so a re-posted step replaces the first.

Revision ID: 0004s
Revises: 0003j
Create Date: 2026-11-30
"""

from alembic import op

revision = "0004s"
down_revision = "0003j"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for statement in (
        """
        CREATE TABLE job_steps (
            job         text NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
            rank        integer NOT NULL CHECK (rank >= 0),
            step        bigint NOT NULL CHECK (step >= 0),
            duration_s  double precision NOT NULL CHECK (duration_s >= 0),
            ts          timestamptz NOT NULL,
            received_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (job, rank, step)
        )
        """,
        "CREATE INDEX job_steps_job_ts ON job_steps (job, ts)",
        "CREATE INDEX job_steps_received_at ON job_steps (received_at)",
    ):
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE job_steps")
