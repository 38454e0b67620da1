"""Incidents: what the analysis engine concluded, with its evidence.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for statement in (
        """
        CREATE TABLE incidents (
            id            bigserial PRIMARY KEY,
            key           text NOT NULL,
            detector      text NOT NULL,
            kind          text NOT NULL,
            state         text NOT NULL DEFAULT 'open' CHECK (state IN ('open', 'closed')),
            severity      text NOT NULL DEFAULT 'error',
            summary       text NOT NULL DEFAULT '',
            primary_node  text,
            suspects      jsonb NOT NULL DEFAULT '[]',
            evidence      jsonb NOT NULL DEFAULT '{}',
            first_seen    timestamptz NOT NULL,
            opened_at     timestamptz NOT NULL DEFAULT now(),
            updated_at    timestamptz NOT NULL DEFAULT now(),
            last_seen     timestamptz NOT NULL DEFAULT now(),
            closed_at     timestamptz
        )
        """,
        # One open incident per fault identity; closed ones are history.
        "CREATE UNIQUE INDEX incidents_open_key ON incidents (key) WHERE state = 'open'",
        "CREATE INDEX incidents_state_opened ON incidents (state, opened_at DESC)",
        "CREATE INDEX incidents_primary_node ON incidents (primary_node, state)",
    ):
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE incidents")
