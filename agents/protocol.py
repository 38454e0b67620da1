"""The wire schema between agent and backend.

This is the one module of ``agents`` that ``app`` imports. Every field is
bounded so that a malformed or hostile batch is refused at the door with a
4xx naming the field, before anything is written.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
)

PROTOCOL_VERSION = 1

# Identifiers: hostnames, interface names, job ids. No spaces, no control chars.
Ident = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@/+-]+$")
]
# PostgreSQL text cannot hold NUL: refuse it here rather than fail mid-COPY.
ShortText = Annotated[str, StringConstraints(max_length=256, pattern=r"^[^\x00]*$")]
LongText = Annotated[str, StringConstraints(max_length=4096, pattern=r"^[^\x00]*$")]

U32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
U64 = Annotated[int, Field(ge=0, le=2**63 - 1)]
Micros = Annotated[float, Field(ge=0, le=600e6)]  # an RTT over ten minutes is garbage
Finite = Annotated[float, Field(ge=-1e18, le=1e18, allow_inf_nan=False)]

MAX_ROWS = 50_000  # per list in one batch: 1 s of a 1000-peer mesh x 4 flows fits easily


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProbeStat(_Strict):
    """One second of ping-mesh probes to one peer on one flow (UDP source port)."""

    ts: AwareDatetime
    peer: Ident
    flow: Annotated[int, Field(ge=0, le=65535)]
    sent: Annotated[int, Field(ge=0, le=100_000)]
    received: Annotated[int, Field(ge=0, le=100_000)]
    rtt_min_us: Micros | None = None
    rtt_p50_us: Micros | None = None
    rtt_max_us: Micros | None = None


class HostSample(_Strict):
    """CPU and memory of the node, one per second."""

    ts: AwareDatetime
    cpu_pct: Annotated[float, Field(ge=0, le=100)]
    load1: Annotated[float, Field(ge=0, le=1e6)]
    mem_total_bytes: U64
    mem_available_bytes: U64


class GpuSample(_Strict):
    """One GPU's NVML readings at one instant. Absent readings are None."""

    ts: AwareDatetime
    gpu: Annotated[int, Field(ge=0, le=255)]
    uuid: ShortText | None = None
    pci_bus_id: ShortText | None = None
    util_pct: Annotated[float, Field(ge=0, le=100)] | None = None
    mem_used_bytes: U64 | None = None
    temp_c: Annotated[float, Field(ge=-50, le=200)] | None = None
    power_w: Annotated[float, Field(ge=0, le=10_000)] | None = None
    sm_clock_mhz: Annotated[float, Field(ge=0, le=10_000)] | None = None
    throttle_reasons: U64 | None = None
    ecc_volatile_sbe: U64 | None = None
    ecc_volatile_dbe: U64 | None = None
    ecc_aggregate_sbe: U64 | None = None
    ecc_aggregate_dbe: U64 | None = None
    retired_pages: U64 | None = None
    remapped_rows_pending: U64 | None = None
    remapped_rows_failed: U64 | None = None
    pcie_replay: U64 | None = None
    nvlink_errors: U64 | None = None


class NicCounter(_Strict):
    """One counter of one interface: its raw value and its rate per second.

    ``rate`` is None on the first reading and after a counter reset (driver
    reload), where no honest rate exists.
    """

    ts: AwareDatetime
    iface: Ident
    counter: Ident  # e.g. rx_bytes, tx_prio3_pause, tx_prio3_pause_duration, out_of_buffer
    value: Annotated[float, Field(ge=0, le=2**64, allow_inf_nan=False)]
    rate: Finite | None = None


EventKind = Literal[
    "xid",
    "nccl_timeout",
    "nccl_error",
    "pfc_frames",
    "gpu_lost",
    "collector_error",
    "agent",
]


class Event(_Strict):
    """Something that happened once: an Xid, an NCCL watchdog timeout, a log error."""

    ts: AwareDatetime
    kind: EventKind
    severity: Literal["info", "warning", "error", "critical"] = "warning"
    job: Ident | None = None
    rank: Annotated[int, Field(ge=0, le=10_000_000)] | None = None
    message: LongText = ""
    attrs: dict[Ident, Any] = Field(default_factory=dict, max_length=64)

    @field_validator("attrs")
    @classmethod
    def _attrs_storable(cls, v: dict[str, Any]) -> dict[str, Any]:
        encoded = json.dumps(v, allow_nan=False)
        if len(encoded) > 16_384:
            raise ValueError("attrs larger than 16 KiB")
        if "\\u0000" in encoded:
            raise ValueError("attrs may not contain NUL characters")
        return v


class Batch(_Strict):
    """Everything one agent observed in one interval (normally one second)."""

    node: Ident
    seq: Annotated[int, Field(ge=0, le=2**62)]
    sent_at: AwareDatetime
    protocol: Literal[1] = PROTOCOL_VERSION
    probes: list[ProbeStat] = Field(default_factory=list, max_length=MAX_ROWS)
    hosts: list[HostSample] = Field(default_factory=list, max_length=600)
    gpus: list[GpuSample] = Field(default_factory=list, max_length=MAX_ROWS)
    nics: list[NicCounter] = Field(default_factory=list, max_length=MAX_ROWS)
    events: list[Event] = Field(default_factory=list, max_length=10_000)


class RegisterRequest(_Strict):
    node: Ident
    hostname: ShortText
    address: ShortText  # data-fabric address the peers probe
    probe_port: Annotated[int, Field(ge=1, le=65535)] = 7447
    rack: Ident | None = None  # ToR switch the node hangs off
    pod: Ident | None = None
    gpu_count: Annotated[int, Field(ge=0, le=64)] = 0
    labels: dict[Ident, ShortText] = Field(default_factory=dict, max_length=64)


class RegisterResponse(_Strict):
    node: str
    token: str


class IngestAck(_Strict):
    node: str
    seq: int
    duplicate: bool
    rows: int


class Peer(_Strict):
    """One entry of a node's pinglist."""

    node: Ident
    address: ShortText
    port: Annotated[int, Field(ge=1, le=65535)]


class Pinglist(_Strict):
    node: str
    version: str
    peers: list[Peer]
