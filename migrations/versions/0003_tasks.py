"""Agent tasks (benchmark runs the backend hands to agents) and bisections.

A bisection's whole state is one JSON document (``BisectionState.to_json()``)
rewritten after every change, so a restarted backend resumes where the last
one stopped. Each task is one member's part of one group of one round.

Revision ID: 0003t
Revises: 0002
Create Date: 2026-11-23
"""

from alembic import op

revision = "0003t"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # asyncpg prepares each statement: one at a time.
    for statement in (
        """
        CREATE TABLE bisections (
            id         bigserial PRIMARY KEY,
            state      jsonb NOT NULL,
            status     text NOT NULL DEFAULT 'running'
                       CHECK (status IN ('running', 'done', 'error')),
            spec       jsonb NOT NULL DEFAULT '{}',
            created_by text NOT NULL DEFAULT '',
            created_at timestamptz NOT NULL DEFAULT now(),
            updated_at timestamptz NOT NULL DEFAULT now()
        )
        """,
        "CREATE INDEX bisections_running ON bisections (id) WHERE status = 'running'",
        """
        CREATE TABLE tasks (
            id           bigserial PRIMARY KEY,
            node         text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
            bisection_id bigint REFERENCES bisections (id) ON DELETE CASCADE,
            round        integer,
            group_id     text,
            kind         text NOT NULL CHECK (kind IN ('net-ring', 'gemm', 'command')),
            spec         jsonb NOT NULL DEFAULT '{}',
            state        text NOT NULL DEFAULT 'pending'
                         CHECK (state IN ('pending', 'running', 'done', 'failed', 'expired')),
            deadline     timestamptz NOT NULL,
            result       jsonb,
            created_at   timestamptz NOT NULL DEFAULT now(),
            started_at   timestamptz,
            finished_at  timestamptz
        )
        """,
        # The long poll's query: a node's pending tasks.
        "CREATE INDEX tasks_node_pending ON tasks (node, id) WHERE state = 'pending'",
        "CREATE INDEX tasks_bisection_round ON tasks (bisection_id, round)",
    ):
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE tasks, bisections")
