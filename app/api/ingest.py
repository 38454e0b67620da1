"""``POST /api/v1/ingest``: one batch from one agent, all or nothing.

The batch is validated whole before anything is written; then, in one
transaction, the ledger row for (node, seq) is claimed and every list is
written with COPY. A retried batch finds its ledger row and is acknowledged
as a duplicate without writing anything twice.
"""

from __future__ import annotations

import json
import zlib
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy import text

from agents.protocol import Batch, IngestAck
from app.analysis.engine import notify_wake
from app.api.deps import PrincipalDep, SessionDep, SettingsDep, require_node
from app.store import partitions

router = APIRouter(prefix="/api/v1", tags=["ingest"])

PROBE_COLUMNS = (
    "ts",
    "src",
    "dst",
    "flow",
    "sent",
    "received",
    "rtt_min_us",
    "rtt_p50_us",
    "rtt_max_us",
)
HOST_COLUMNS = ("ts", "node", "cpu_pct", "load1", "mem_total_bytes", "mem_available_bytes")
GPU_FIELDS = (
    "gpu",
    "uuid",
    "pci_bus_id",
    "util_pct",
    "mem_used_bytes",
    "temp_c",
    "power_w",
    "sm_clock_mhz",
    "throttle_reasons",
    "ecc_volatile_sbe",
    "ecc_volatile_dbe",
    "ecc_aggregate_sbe",
    "ecc_aggregate_dbe",
    "retired_pages",
    "remapped_rows_pending",
    "remapped_rows_failed",
    "pcie_replay",
    "nvlink_errors",
)
GPU_COLUMNS = ("ts", "node", *GPU_FIELDS)
NIC_COLUMNS = ("ts", "node", "iface", "counter", "value", "rate")
EVENT_COLUMNS = ("ts", "node", "kind", "severity", "job", "rank", "message", "attrs")


def _unprocessable(errors: list[dict[str, Any]]) -> JSONResponse:
    return JSONResponse(
        status_code=status.HTTP_422_UNPROCESSABLE_CONTENT, content={"detail": errors}
    )


def _field(loc: tuple[Any, ...]) -> str:
    """('probes', 3, 'ts') -> 'probes[3].ts': the name an operator greps for."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def decode_body(raw: bytes, encoding: str, limit: int) -> bytes:
    encoding = encoding.lower().strip()
    if encoding in ("", "identity"):
        return raw
    if encoding != "gzip":
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, f"unsupported Content-Encoding {encoding!r}"
        )
    try:
        d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        out = d.decompress(raw, limit + 1)
    except zlib.error as e:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"body is not valid gzip: {e}") from e
    if len(out) > limit or d.unconsumed_tail:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"body exceeds {limit} bytes")
    return out


def check_time_window(batch: Batch, retention_days: int, skew_s: float) -> list[dict[str, Any]]:
    """Samples outside the stored window are refused, naming the field."""
    oldest, _ = partitions.window(retention_days)
    newest = datetime.now(UTC) + timedelta(seconds=skew_s)
    errors = []
    for name in ("probes", "hosts", "gpus", "nics", "events"):
        for i, row in enumerate(getattr(batch, name)):
            if not oldest <= row.ts <= newest:
                errors.append(
                    {
                        "loc": ["body", name, i, "ts"],
                        "field": f"{name}[{i}].ts",
                        "msg": f"timestamp {row.ts.isoformat()} outside [{oldest.isoformat()},"
                        f" {newest.isoformat()}] (retention or clock skew)",
                        "type": "time_window",
                    }
                )
                if len(errors) >= 20:
                    return errors
    return errors


def parse_batch(body: bytes) -> Batch | list[dict[str, Any]]:
    try:
        return Batch.model_validate_json(body)
    except ValidationError as e:
        return [
            {
                "loc": ["body", *e_["loc"]],
                "field": _field(e_["loc"]),
                "msg": e_["msg"],
                "type": e_["type"],
            }
            for e_ in e.errors(include_url=False, include_input=False)[:50]
        ]


async def store_batch(session: Any, batch: Batch) -> IngestAck:
    """Write one validated batch in one transaction; idempotent on (node, seq)."""
    node = batch.node
    rows = (
        len(batch.probes) + len(batch.hosts) + len(batch.gpus) + len(batch.nics) + len(batch.events)
    )
    claimed = (
        await session.execute(
            text(
                "INSERT INTO ingest_batches (node, seq, rows) VALUES (:n, :s, :r) "
                "ON CONFLICT DO NOTHING RETURNING seq"
            ),
            {"n": node, "s": batch.seq, "r": rows},
        )
    ).scalar()
    if claimed is None:
        await session.rollback()
        return IngestAck(node=node, seq=batch.seq, duplicate=True, rows=0)
    raw = (await (await session.connection()).get_raw_connection()).driver_connection
    if batch.probes:
        await raw.copy_records_to_table(
            "probe_stats",
            columns=PROBE_COLUMNS,
            records=[
                (
                    p.ts,
                    node,
                    p.peer,
                    p.flow,
                    p.sent,
                    p.received,
                    p.rtt_min_us,
                    p.rtt_p50_us,
                    p.rtt_max_us,
                )
                for p in batch.probes
            ],
        )
    if batch.hosts:
        await raw.copy_records_to_table(
            "host_samples",
            columns=HOST_COLUMNS,
            records=[
                (h.ts, node, h.cpu_pct, h.load1, h.mem_total_bytes, h.mem_available_bytes)
                for h in batch.hosts
            ],
        )
    if batch.gpus:
        await raw.copy_records_to_table(
            "gpu_samples",
            columns=GPU_COLUMNS,
            records=[(g.ts, node, *(getattr(g, f) for f in GPU_FIELDS)) for g in batch.gpus],
        )
    if batch.nics:
        await raw.copy_records_to_table(
            "nic_counters",
            columns=NIC_COLUMNS,
            records=[(c.ts, node, c.iface, c.counter, c.value, c.rate) for c in batch.nics],
        )
    if batch.events:
        await raw.copy_records_to_table(
            "events",
            columns=EVENT_COLUMNS,
            records=[
                (e.ts, node, e.kind, e.severity, e.job, e.rank, e.message, json.dumps(e.attrs))
                for e in batch.events
            ],
        )
    await session.execute(
        text(
            "UPDATE nodes SET last_seen = greatest(coalesce(last_seen, :t), :t),"
            " last_seq = greatest(coalesce(last_seq, :s), :s) WHERE id = :n"
        ),
        {"t": datetime.now(UTC), "s": batch.seq, "n": node},
    )
    if batch.events or any(p.received < p.sent for p in batch.probes):
        await notify_wake(await session.connection(), node)
    await session.commit()
    return IngestAck(node=node, seq=batch.seq, duplicate=False, rows=rows)


@router.post("/ingest", response_model=IngestAck)
async def ingest(
    request: Request, session: SessionDep, settings: SettingsDep, principal: PrincipalDep
) -> Any:
    """Store one telemetry batch from one agent (gzip accepted); idempotent on (node, seq)."""
    raw = await request.body()
    if len(raw) > settings.max_body_bytes:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE, f"body exceeds {settings.max_body_bytes} bytes"
        )
    body = decode_body(raw, request.headers.get("content-encoding", ""), settings.max_body_bytes)
    parsed = parse_batch(body)
    if isinstance(parsed, list):
        return _unprocessable(parsed)
    require_node(principal, parsed.node)
    window_errors = check_time_window(parsed, settings.retention_days, settings.max_clock_skew_s)
    if window_errors:
        return _unprocessable(window_errors)
    return await store_batch(session, parsed)
