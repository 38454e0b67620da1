"""Training jobs and where their ranks run, for hang localisation.

Revision ID: 0003j
Revises: 0002
Create Date: 2026-11-23
"""

from alembic import op

revision = "0003j"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for statement in (
        """
        CREATE TABLE jobs (
            id            text PRIMARY KEY,
            name          text NOT NULL DEFAULT '',
            state         text NOT NULL DEFAULT 'running'
                          CHECK (state IN ('running', 'finished', 'failed', 'cancelled')),
            registered_by text,
            created_at    timestamptz NOT NULL DEFAULT now(),
            updated_at    timestamptz NOT NULL DEFAULT now()
        )
        """,
        # node is not a foreign key: a scheduler may place ranks on a node
        # before that node's agent has registered.
        """
        CREATE TABLE job_ranks (
            job              text NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
            rank             integer NOT NULL CHECK (rank >= 0),
            node             text NOT NULL,
            gpu              smallint CHECK (gpu >= 0),
            last_seq         bigint,
            last_progress_at timestamptz,
            PRIMARY KEY (job, rank)
        )
        """,
        "CREATE INDEX job_ranks_node ON job_ranks (node)",
        "CREATE INDEX jobs_state_created ON jobs (state, created_at DESC)",
        # A job's events, for its progress page; propagates to every partition.
        "CREATE INDEX events_job_ts ON events (job, ts) WHERE job IS NOT NULL",
    ):
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS events_job_ts")
    op.execute("DROP TABLE job_ranks, jobs")
