"""Actions: isolation audit log and state, actuator queue, webhook subscriptions and outbox.

Revision ID: 0003a
Revises: 0002
Create Date: 2026-11-23
"""

from alembic import op

revision = "0003a"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for statement in (
        # Every isolation decision, automatic or manual, taken or refused.
        """
        CREATE TABLE isolation_audit (
            id          bigserial PRIMARY KEY,
            ts          timestamptz NOT NULL DEFAULT now(),
            node        text,
            action      text NOT NULL CHECK (action IN ('isolate', 'release')),
            decision    text NOT NULL,
            reason      text NOT NULL DEFAULT '',
            rule        text,
            incident_id bigint,
            actor       text NOT NULL,
            automatic   boolean NOT NULL DEFAULT false,
            dry_run     boolean NOT NULL DEFAULT false,
            details     jsonb NOT NULL DEFAULT '{}'
        )
        """,
        "CREATE INDEX isolation_audit_node ON isolation_audit (node, ts DESC)",
        "CREATE INDEX isolation_audit_incident ON isolation_audit (incident_id, id DESC)",
        "CREATE INDEX isolation_audit_ts ON isolation_audit (ts) WHERE decision = 'isolated'",
        # Why and since when a node is isolated; nodes.state stays the one truth
        # schedulers read, this row carries the context of the last change.
        """
        CREATE TABLE node_isolation (
            node         text PRIMARY KEY,
            state        text NOT NULL CHECK (state IN ('isolated', 'released')),
            reason       text NOT NULL DEFAULT '',
            actor        text NOT NULL,
            automatic    boolean NOT NULL DEFAULT false,
            incident_id  bigint,
            changed_at   timestamptz NOT NULL DEFAULT now()
        )
        """,
        # External actuators (Slurm, Kubernetes): a queue, retried by a worker.
        """
        CREATE TABLE actuations (
            id              bigserial PRIMARY KEY,
            node            text NOT NULL,
            actuator        text NOT NULL,
            op              text NOT NULL CHECK (op IN ('isolate', 'release')),
            reason          text NOT NULL DEFAULT '',
            incident_id     bigint,
            dry_run         boolean NOT NULL DEFAULT false,
            state           text NOT NULL DEFAULT 'pending'
                            CHECK (state IN ('pending', 'done', 'dead')),
            attempts        integer NOT NULL DEFAULT 0,
            next_attempt_at timestamptz NOT NULL DEFAULT now(),
            last_error      text,
            output          text,
            created_at      timestamptz NOT NULL DEFAULT now(),
            updated_at      timestamptz NOT NULL DEFAULT now()
        )
        """,
        "CREATE INDEX actuations_due ON actuations (next_attempt_at) WHERE state = 'pending'",
        "CREATE INDEX actuations_node ON actuations (node, id DESC)",
        "CREATE INDEX actuations_incident ON actuations (incident_id)",
        """
        CREATE TABLE webhooks (
            id           serial PRIMARY KEY,
            name         text NOT NULL,
            url          text NOT NULL,
            secret       text NOT NULL,
            format       text NOT NULL DEFAULT 'native'
                         CHECK (format IN ('native', 'slack', 'alertmanager')),
            kinds        text[],
            min_severity text NOT NULL DEFAULT 'info',
            enabled      boolean NOT NULL DEFAULT true,
            created_at   timestamptz NOT NULL DEFAULT now()
        )
        """,
        # Written in the transaction of the incident change it reports.
        """
        CREATE TABLE webhook_outbox (
            id              bigserial PRIMARY KEY,
            webhook_id      integer NOT NULL REFERENCES webhooks (id) ON DELETE CASCADE,
            incident_id     bigint,
            event           text NOT NULL,
            payload         jsonb NOT NULL,
            state           text NOT NULL DEFAULT 'pending'
                            CHECK (state IN ('pending', 'delivered', 'dead')),
            attempts        integer NOT NULL DEFAULT 0,
            next_attempt_at timestamptz NOT NULL DEFAULT now(),
            last_status     integer,
            last_error      text,
            created_at      timestamptz NOT NULL DEFAULT now(),
            delivered_at    timestamptz
        )
        """,
        "CREATE INDEX webhook_outbox_due ON webhook_outbox (next_attempt_at)"
        " WHERE state = 'pending'",
        "CREATE INDEX webhook_outbox_webhook ON webhook_outbox (webhook_id, id DESC)",
        "CREATE INDEX webhook_outbox_incident ON webhook_outbox (incident_id, webhook_id)",
    ):
        op.execute(statement)


def downgrade() -> None:
    op.execute(
        "DROP TABLE webhook_outbox, webhooks, actuations, node_isolation, isolation_audit"
    )
