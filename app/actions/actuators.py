"""Actuators: how an isolation reaches the systems that schedule work.

- ``db``: ``nodes.state`` (always; done in the decision's own transaction by
  ``app.actions.policy``), which ``GET /api/v1/nodes?schedulable=true`` reads;
- ``slurm``: a command run per node, by default
  ``scontrol update nodename={hostname} state=drain reason={reason}``; the
  template is split like a shell line and each word formatted on its own, so a
  reason with spaces stays one argument and nothing goes through a shell;
- ``kubernetes``: cordon (``spec.unschedulable``) and a ``NoSchedule`` taint
  through the ``kubernetes`` client, imported only when used; without the
  package the actuation fails with an error saying what to install.

External actuations are rows of ``actuations``, written with the decision and
carried out by ``ActuatorWorker`` on any replica (rows claimed with
``FOR UPDATE SKIP LOCKED``), retried with exponential backoff up to
``max_attempts``; each attempt's outcome is written onto the incident's
``evidence.actions``, so a failing actuator is visible where the incident is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
from typing import Any, Protocol

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.analysis.correlate import action_entry
from app.settings import Settings

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 60.0
MAX_OUTPUT = 4000


class ActuatorError(Exception):
    """An actuation that did not happen; the message says why."""


class Actuator(Protocol):
    name: str

    async def apply(
        self, op: str, node: str, hostname: str, reason: str, dry_run: bool
    ) -> str: ...


class SlurmActuator:
    """Drains and resumes nodes with a configurable ``scontrol`` command line."""

    name = "slurm"

    def __init__(self, isolate_command: str, release_command: str) -> None:
        self.templates = {"isolate": isolate_command, "release": release_command}

    def argv(self, op: str, node: str, hostname: str, reason: str) -> list[str]:
        # One line: scontrol keeps the reason as one field; newlines would end it.
        reason = " ".join(reason.split())
        return [
            word.format(node=node, hostname=hostname, reason=reason)
            for word in shlex.split(self.templates[op])
        ]

    async def apply(self, op: str, node: str, hostname: str, reason: str, dry_run: bool) -> str:
        argv = self.argv(op, node, hostname, reason)
        if dry_run:
            return "dry-run: " + shlex.join(argv)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
        except FileNotFoundError as e:
            raise ActuatorError(f"{argv[0]}: command not found (slurm_{op}_command)") from e
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), COMMAND_TIMEOUT_S)
        except TimeoutError as e:
            proc.kill()
            await proc.wait()
            raise ActuatorError(f"{shlex.join(argv)}: no answer in {COMMAND_TIMEOUT_S:g}s") from e
        text_out = out.decode(errors="replace")[-MAX_OUTPUT:]
        if proc.returncode != 0:
            raise ActuatorError(f"{shlex.join(argv)} exited {proc.returncode}: {text_out.strip()}")
        return text_out


class KubernetesActuator:
    """Cordons and taints the node (and undoes both) through the Kubernetes API."""

    name = "kubernetes"

    def __init__(self, taint_key: str = "meshwatch.io/isolated") -> None:
        self.taint_key = taint_key

    def _api(self) -> Any:
        try:
            from kubernetes import client, config  # optional extra: imported when used
        except ImportError as e:
            raise ActuatorError(
                "the kubernetes actuator needs the 'kubernetes' Python package"
                " (pip install kubernetes)"
            ) from e
        try:
            config.load_incluster_config()
        except config.ConfigException:
            try:
                config.load_kube_config()
            except Exception as e:  # no kubeconfig either: say so plainly
                raise ActuatorError(f"no Kubernetes credentials: {e}") from e
        return client.CoreV1Api()

    def _apply_sync(self, op: str, hostname: str, reason: str, dry_run: bool) -> str:
        api = self._api()
        current = api.read_node(hostname)
        taints = [
            t.to_dict() if hasattr(t, "to_dict") else dict(t)
            for t in (current.spec.taints or [])
            if (t.key if hasattr(t, "key") else t["key"]) != self.taint_key
        ]
        if op == "isolate":
            taints.append({"key": self.taint_key, "value": "true", "effect": "NoSchedule"})
        body = {"spec": {"unschedulable": op == "isolate", "taints": taints}}
        kwargs = {"dry_run": "All"} if dry_run else {}
        api.patch_node(hostname, body, **kwargs)
        verb = "cordoned and tainted" if op == "isolate" else "uncordoned and untainted"
        return ("dry-run: " if dry_run else "") + f"node {hostname} {verb}"

    async def apply(self, op: str, node: str, hostname: str, reason: str, dry_run: bool) -> str:
        try:
            return await asyncio.to_thread(self._apply_sync, op, hostname, reason, dry_run)
        except ActuatorError:
            raise
        except Exception as e:  # API errors carry their status and body in str()
            raise ActuatorError(f"kubernetes: {type(e).__name__}: {e}"[:MAX_OUTPUT]) from e


def actuators_from_settings(s: Settings) -> dict[str, Actuator]:
    return {
        "slurm": SlurmActuator(s.slurm_isolate_command, s.slurm_release_command),
        "kubernetes": KubernetesActuator(s.kubernetes_taint_key),
    }


class ActuatorWorker:
    """Carries out pending actuations, with retries; safe on every replica."""

    def __init__(
        self,
        engine: AsyncEngine,
        actuators: dict[str, Actuator],
        max_attempts: int = 5,
        backoff_s: float = 2.0,
        interval_s: float = 1.0,
    ) -> None:
        self.engine = engine
        self.actuators = actuators
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.interval_s = interval_s

    @classmethod
    def from_settings(cls, engine: AsyncEngine, s: Settings) -> ActuatorWorker:
        return cls(
            engine,
            actuators_from_settings(s),
            s.actuator_max_attempts,
            s.actuator_backoff_s,
            s.webhook_interval_s,
        )

    async def run(self) -> None:
        while True:
            try:
                while await self.run_one():
                    pass
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("actuator worker round failed; retrying")
            await asyncio.sleep(self.interval_s)

    async def run_one(self) -> bool:
        """Claim one due actuation and carry it out; False when none is due."""
        async with self.engine.begin() as conn:
            row = (
                await conn.execute(
                    text(
                        "SELECT a.id, a.node, a.actuator, a.op, a.reason, a.incident_id,"
                        " a.dry_run, a.attempts, coalesce(n.hostname, a.node) AS hostname"
                        " FROM actuations a LEFT JOIN nodes n ON n.id = a.node"
                        " WHERE a.state = 'pending' AND a.next_attempt_at <= now()"
                        " ORDER BY a.id LIMIT 1 FOR UPDATE OF a SKIP LOCKED"
                    )
                )
            ).first()
            if row is None:
                return False
            attempts = row.attempts + 1
            actuator = self.actuators.get(row.actuator)
            error: str | None = None
            output = ""
            try:
                if actuator is None:
                    raise ActuatorError(f"unknown actuator {row.actuator!r}")
                output = await actuator.apply(
                    row.op, row.node, row.hostname, row.reason, row.dry_run
                )
            except ActuatorError as e:
                error = str(e)
            except Exception as e:  # an actuator bug is a failed attempt, not a dead worker
                log.exception("actuator %s failed", row.actuator)
                error = f"{type(e).__name__}: {e}"
            if error is None:
                state, delay = "done", 0.0
            elif attempts >= self.max_attempts:
                state, delay = "dead", 0.0
            else:
                state, delay = "pending", self.backoff_s * 2 ** (attempts - 1)
            if error:
                log.warning("actuator %s %s %s: attempt %d failed: %s", row.actuator, row.op,
                            row.node, attempts, error)
            updated = (
                await conn.execute(
                    text(
                        "UPDATE actuations SET state = :state, attempts = :attempts,"
                        " last_error = :error, output = :output, updated_at = clock_timestamp(),"
                        " next_attempt_at = clock_timestamp() + make_interval(secs => :delay)"
                        " WHERE id = :id RETURNING id, actuator, op, state, attempts,"
                        " last_error, dry_run, updated_at"
                    ),
                    {"state": state, "attempts": attempts, "error": error,
                     "output": output[-MAX_OUTPUT:], "delay": delay, "id": row.id},
                )
            ).one()
            if row.incident_id is not None:
                await record_on_incident(conn, row.incident_id, updated)
        return True


async def record_on_incident(conn: Any, incident_id: int, actuation: Any) -> None:
    """Write an actuation's latest outcome under the incident's ``evidence.actions``."""
    key = f"{actuation.actuator}:{actuation.op}:{actuation.id}"
    await conn.execute(
        text(
            "UPDATE incidents SET evidence = evidence || jsonb_build_object('actions',"
            " coalesce(evidence->'actions', '{}'::jsonb)"
            " || jsonb_build_object(CAST(:key AS text), CAST(:entry AS jsonb)))"
            " WHERE id = :id"
        ),
        {"key": key, "entry": json.dumps(action_entry(actuation)), "id": incident_id},
    )
