"""The isolation policy: per incident kind and confidence, alert only or isolate,
behind guardrails, with every decision in the audit log.

Guardrails, checked in this order before an automatic isolation:

- the incident must name a node as its top suspect, at the rule's minimum
  score, and be *strong* (one strong signal or two independent sources agree,
  see ``app.analysis.correlate``): never isolate on a single weak signal;
- node cooldown: no automatic isolation of a node within ``cooldown_s`` of its
  last isolation or release, so a flapping node is not cycled in and out;
- rate: at most ``max_per_hour`` automatic isolations in the last hour;
- fraction: at most ``max_fraction`` of the nodes isolated at once (never
  fewer than ``min_nodes``), whoever isolated them;
- dry-run: everything above is evaluated and audited, nothing is changed.

A refused isolation becomes an alert that says why. Decisions are serialised
by a transaction-level advisory lock, so two replicas or a manual call racing
the engine cannot both take the last isolation slot.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.settings import Settings

# Two-key advisory lock ("mw", "is"): a key space apart from the single-bigint
# locks that engine and driver leaders hold for their whole life.
ISOLATION_LOCK = (0x6D77, 0x6973)
LOCK_TIMEOUT_S = 10.0


async def lock_isolation(conn: AsyncConnection, timeout_s: float = LOCK_TIMEOUT_S) -> None:
    """Serialise isolation decisions until the end of this transaction.

    Tried rather than waited for, so a stuck holder cannot stall the analysis
    engine: after ``timeout_s`` this raises ``TimeoutError``.
    """
    deadline = time.monotonic() + timeout_s
    params = {"k1": ISOLATION_LOCK[0], "k2": ISOLATION_LOCK[1]}
    while not (
        await conn.execute(text("SELECT pg_try_advisory_xact_lock(:k1, :k2)"), params)
    ).scalar():
        if time.monotonic() > deadline:
            raise TimeoutError("isolation lock busy")
        await asyncio.sleep(0.02)
POLICY_ACTOR = "policy"


@dataclass(frozen=True)
class Rule:
    """What to do about incidents of a kind (a glob) at or above a score."""

    kind: str
    action: Literal["isolate", "alert"]
    min_score: float = 0.8

    @property
    def name(self) -> str:
        if self.action == "alert":
            return f"{self.kind} -> alert"
        return f"{self.kind} >= {self.min_score:g} -> isolate"


# Kinds that take a node out on their own at high confidence; the rest alert.
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule("node-unreachable", "isolate", 0.8),
    Rule("gpu-lost", "isolate", 0.8),
    Rule("gpu-fault", "isolate", 0.8),
    Rule("pfc-storm", "isolate", 0.9),
    Rule("*", "alert", 0.0),
)


def rules_from_settings(settings: Settings) -> tuple[Rule, ...]:
    if not settings.isolation_rules:
        return DEFAULT_RULES
    rules = tuple(
        Rule(str(r["kind"]), r.get("action", "alert"), float(r.get("min_score", 0.8)))
        for r in settings.isolation_rules
    )
    for r in rules:
        if r.action not in ("isolate", "alert"):
            raise ValueError(f"isolation rule {r.kind!r}: action must be isolate or alert")
    return rules


@dataclass(frozen=True)
class Guardrails:
    """Limits on automatic isolation (see the module docstring)."""

    dry_run: bool = False
    max_fraction: float = 0.05
    min_nodes: int = 1
    max_per_hour: int = 10
    cooldown_s: float = 1800.0

    @classmethod
    def from_settings(cls, s: Settings) -> Guardrails:
        return cls(
            dry_run=s.isolation_dry_run,
            max_fraction=s.max_isolated_fraction,
            min_nodes=s.max_isolated_min_nodes,
            max_per_hour=s.max_isolations_per_hour,
            cooldown_s=s.node_cooldown_s,
        )

    def allowed_isolated(self, total_nodes: int) -> int:
        # The epsilon keeps 0.05 * 100 at 5 despite binary floating point.
        return max(self.min_nodes, math.floor(self.max_fraction * total_nodes + 1e-9))

    async def fraction_refusal(self, conn: AsyncConnection) -> str | None:
        total, isolated = (
            await conn.execute(
                text("SELECT count(*), count(*) FILTER (WHERE state = 'isolated') FROM nodes")
            )
        ).one()
        allowed = self.allowed_isolated(total)
        if isolated + 1 > allowed:
            return (
                f"max isolated fraction: {isolated} of {total} nodes already isolated,"
                f" limit {allowed} ({self.max_fraction:.0%})"
            )
        return None

    async def refusal(self, conn: AsyncConnection, node: str) -> str | None:
        """Why an automatic isolation of ``node`` is not allowed now, or None."""
        since = (
            await conn.execute(
                text(
                    "SELECT extract(epoch FROM now() - changed_at) FROM node_isolation"
                    " WHERE node = :n"
                ),
                {"n": node},
            )
        ).scalar()
        if since is not None and float(since) < self.cooldown_s:
            # Stable wording (no elapsed seconds): the audit logs changes of reason.
            return f"node cooldown: isolated or released less than {self.cooldown_s:g}s ago"
        recent = (
            await conn.execute(
                text(
                    "SELECT count(*) FROM isolation_audit WHERE decision = 'isolated'"
                    " AND automatic AND NOT dry_run AND ts > now() - interval '1 hour'"
                )
            )
        ).scalar()
        if recent >= self.max_per_hour:
            return f"max isolations per hour: {recent} in the last hour"
        return await self.fraction_refusal(conn)


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one incident, as audited."""

    decision: str  # isolated | refused | dry-run | alert | already-isolated
    reason: str
    rule: str | None
    node: str | None
    incident_id: int | None
    score: float | None = None

    @property
    def notable(self) -> bool:
        """Worth an alert of its own when it changes (not plain 'alert only')."""
        return self.decision in ("isolated", "refused", "dry-run")

    def as_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "reason": self.reason,
            "rule": self.rule,
            "node": self.node,
            "incident": self.incident_id,
            "score": self.score,
        }


class IsolationPolicy:
    """Decides, per correlated incident, between alerting and isolating its node."""

    def __init__(
        self,
        rules: Sequence[Rule] = DEFAULT_RULES,
        guardrails: Guardrails | None = None,
        actuators: Sequence[str] = (),
        actuator_dry_run: dict[str, bool] | None = None,
    ) -> None:
        self.rules = tuple(rules)
        self.guardrails = guardrails or Guardrails()
        self.actuators = tuple(actuators)
        self.actuator_dry_run = actuator_dry_run or {}

    @classmethod
    def from_settings(cls, s: Settings) -> IsolationPolicy:
        return cls(
            rules_from_settings(s),
            Guardrails.from_settings(s),
            external_actuators(s),
            {"slurm": s.slurm_dry_run, "kubernetes": s.kubernetes_dry_run},
        )

    def match(self, kind: str) -> Rule:
        for rule in self.rules:
            if fnmatch.fnmatchcase(kind, rule.kind):
                return rule
        return Rule("*", "alert", 0.0)

    async def decide(self, conn: AsyncConnection, incident: dict[str, Any]) -> Decision:
        """Decide for one open incident and, when the answer is isolate, isolate."""
        rule = self.match(incident["kind"])
        suspects = incident.get("suspects") or []
        top = suspects[0] if suspects else None
        node = top["id"] if top and top.get("type") == "node" else None
        score = float(top.get("score", 0.0)) if top else None
        inc_id = incident.get("id")

        def answer(decision: str, reason: str) -> Decision:
            return Decision(decision, reason, rule.name, node, inc_id, score)

        if rule.action == "alert":
            return answer("alert", f"rule '{rule.name}' alerts only")
        if node is None:
            return answer("alert", "the top suspect is not a node")
        if score is None or score < rule.min_score:
            return answer("alert", f"confidence below {rule.min_score:g}")
        if (incident.get("evidence") or {}).get("strength") != "strong":
            return answer("alert", "a single weak signal never isolates")
        await lock_isolation(conn)
        state = (
            await conn.execute(
                text("SELECT state FROM nodes WHERE id = :n FOR UPDATE"), {"n": node}
            )
        ).scalar()
        if state is None:
            return answer("alert", "the suspect node is not registered")
        if state == "isolated":
            return answer("already-isolated", "the node is already isolated")
        refusal = await self.guardrails.refusal(conn, node)
        if refusal:
            return answer("refused", refusal)
        if self.guardrails.dry_run:
            return answer("dry-run", "would isolate (dry-run)")
        why = f"rule '{rule.name}' at score {score:.2f}"
        await apply_isolation(
            conn,
            node,
            reason=f"{incident.get('summary') or incident['kind']} ({why})",
            actor=POLICY_ACTOR,
            incident_id=inc_id,
            automatic=True,
            actuators=self.actuators,
            actuator_dry_run=self.actuator_dry_run,
            rule=rule.name,
        )
        return answer("isolated", why)

    async def evaluate(self, conn: AsyncConnection, incident: dict[str, Any]) -> Decision | None:
        """Decide, and audit the decision when it differs from the last one for
        this incident; returns None when nothing changed."""
        decision = await self.decide(conn, incident)
        last = (
            await conn.execute(
                text(
                    "SELECT decision, reason FROM isolation_audit WHERE incident_id = :i"
                    " ORDER BY id DESC LIMIT 1"
                ),
                {"i": decision.incident_id},
            )
        ).first()
        if last is not None and (
            (last.decision, last.reason) == (decision.decision, decision.reason)
            # The isolation this incident caused is what makes its node isolated now.
            or (last.decision, decision.decision) == ("isolated", "already-isolated")
        ):
            return None
        if decision.decision != "isolated":  # apply_isolation audited it already
            await audit(
                conn,
                node=decision.node,
                action="isolate",
                decision=decision.decision,
                reason=decision.reason,
                rule=decision.rule,
                incident_id=decision.incident_id,
                actor=POLICY_ACTOR,
                automatic=True,
                dry_run=decision.decision == "dry-run",
                details={"score": decision.score, "kind": incident["kind"]},
            )
        return decision


def external_actuators(s: Settings) -> tuple[str, ...]:
    names = tuple(a.strip() for a in s.actuators.split(",") if a.strip())
    for a in names:
        if a not in ("slurm", "kubernetes"):
            raise ValueError(f"unknown actuator {a!r}: choose slurm, kubernetes")
    return names


async def audit(
    conn: AsyncConnection,
    *,
    node: str | None,
    action: str,
    decision: str,
    reason: str,
    actor: str,
    rule: str | None = None,
    incident_id: int | None = None,
    automatic: bool = False,
    dry_run: bool = False,
    details: dict[str, Any] | None = None,
) -> int:
    """One audit row: what, why, which incident, which rule, by whom."""
    return (
        await conn.execute(
            text(
                "INSERT INTO isolation_audit (node, action, decision, reason, rule, incident_id,"
                " actor, automatic, dry_run, details) VALUES (:node, :action, :decision,"
                " :reason, :rule, :incident, :actor, :automatic, :dry_run,"
                " CAST(:details AS jsonb)) RETURNING id"
            ),
            {
                "node": node,
                "action": action,
                "decision": decision,
                "reason": reason,
                "rule": rule,
                "incident": incident_id,
                "actor": actor,
                "automatic": automatic,
                "dry_run": dry_run,
                "details": json.dumps(details or {}, default=str),
            },
        )
    ).scalar_one()


async def _set_state(
    conn: AsyncConnection,
    node: str,
    *,
    op: Literal["isolate", "release"],
    reason: str,
    actor: str,
    incident_id: int | None,
    automatic: bool,
    actuators: Sequence[str],
    actuator_dry_run: dict[str, bool],
    rule: str | None,
) -> int:
    node_state, iso_state, decision = (
        ("isolated", "isolated", "isolated") if op == "isolate" else ("active", "released",
                                                                        "released")
    )
    # The database actuator: what schedulers read through the API.
    await conn.execute(
        text("UPDATE nodes SET state = :s WHERE id = :n"), {"s": node_state, "n": node}
    )
    await conn.execute(
        text(
            "INSERT INTO node_isolation (node, state, reason, actor, automatic, incident_id,"
            " changed_at) VALUES (:n, :s, :reason, :actor, :auto, :inc, now())"
            " ON CONFLICT (node) DO UPDATE SET state = EXCLUDED.state, reason = EXCLUDED.reason,"
            " actor = EXCLUDED.actor, automatic = EXCLUDED.automatic,"
            " incident_id = EXCLUDED.incident_id, changed_at = EXCLUDED.changed_at"
        ),
        {"n": node, "s": iso_state, "reason": reason, "actor": actor, "auto": automatic,
         "inc": incident_id},
    )
    audit_id = await audit(
        conn,
        node=node,
        action=op,
        decision=decision,
        reason=reason,
        rule=rule,
        incident_id=incident_id,
        actor=actor,
        automatic=automatic,
        details={"actuators": ["db", *actuators]},
    )
    await conn.execute(
        text(
            "INSERT INTO actuations (node, actuator, op, reason, incident_id, state, attempts)"
            " VALUES (:n, 'db', :op, :reason, :inc, 'done', 1)"
        ),
        {"n": node, "op": op, "reason": reason, "inc": incident_id},
    )
    for name in actuators:
        await conn.execute(
            text(
                "INSERT INTO actuations (node, actuator, op, reason, incident_id, dry_run)"
                " VALUES (:n, :a, :op, :reason, :inc, :dry)"
            ),
            {"n": node, "a": name, "op": op, "reason": reason, "inc": incident_id,
             "dry": bool(actuator_dry_run.get(name))},
        )
    return audit_id


async def apply_isolation(
    conn: AsyncConnection,
    node: str,
    *,
    reason: str,
    actor: str,
    incident_id: int | None = None,
    automatic: bool = False,
    actuators: Sequence[str] = (),
    actuator_dry_run: dict[str, bool] | None = None,
    rule: str | None = None,
) -> int:
    """Isolate ``node`` in this transaction: node state, audit row, actuator queue.
    The caller holds ``ISOLATION_LOCK`` and has checked the guardrails."""
    return await _set_state(
        conn, node, op="isolate", reason=reason, actor=actor, incident_id=incident_id,
        automatic=automatic, actuators=actuators, actuator_dry_run=actuator_dry_run or {},
        rule=rule,
    )


async def apply_release(
    conn: AsyncConnection,
    node: str,
    *,
    reason: str,
    actor: str,
    actuators: Sequence[str] = (),
    actuator_dry_run: dict[str, bool] | None = None,
) -> int:
    """Put ``node`` back into scheduling: node state, audit row, actuator queue."""
    return await _set_state(
        conn, node, op="release", reason=reason, actor=actor, incident_id=None,
        automatic=False, actuators=actuators, actuator_dry_run=actuator_dry_run or {},
        rule=None,
    )
