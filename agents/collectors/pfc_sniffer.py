"""Count 802.1Qbb PFC frames seen on an interface, per source MAC and priority.

A raw AF_PACKET socket with a classic BPF filter (EtherType 0x8808, opcode
0x0101) hands only PFC frames to a reader thread, which counts them. On the
sending host's own interface the frames show as outgoing (what its NIC's
tx_pause counter counts); on a switch or bridge port they show as incoming
(what a PFC watchdog sees). A Linux bridge never forwards them, so the peers
never see them.

A real NIC consumes the PFC frames it receives in its MAC and makes the ones
it sends in hardware, so on a host this sees frames sent by software; its
place is the lab and the switch side. Each frame seen is a pause *sent* by
the port at its source MAC, which is why ``pfc_frames_prio{p}`` feeds the
storm detector as that port's tx pause rate.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import ClassVar, Literal

from agents.collectors.base import Collector, Samples
from agents.pfc import MAC_CONTROL_ETHERTYPE, PFC_OPCODE, parse_pfc_frame
from agents.protocol import Event, NicCounter

log = logging.getLogger(__name__)

ETH_P_ALL = 0x0003
SO_ATTACH_FILTER = 26
PACKET_OUTGOING = 4  # sll_pkttype of frames this host sends

Direction = Literal["both", "rx", "tx"]


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


# ldh [12]; jeq #0x8808 ? next : drop; ldh [14]; jeq #0x0101 ? accept : drop
_BPF_PFC = [
    (0x28, 0, 0, 12),
    (0x15, 0, 3, MAC_CONTROL_ETHERTYPE),
    (0x28, 0, 0, 14),
    (0x15, 0, 1, PFC_OPCODE),
    (0x06, 0, 0, 0x0000FFFF),
    (0x06, 0, 0, 0),
]


def _attach_pfc_filter(sock: socket.socket) -> None:
    program = (_SockFilter * len(_BPF_PFC))(*[_SockFilter(*insn) for insn in _BPF_PFC])
    fprog = _SockFprog(len(_BPF_PFC), program)
    # The kernel copies the program during setsockopt; fprog may go after.
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(fprog))


@dataclass
class _Tally:
    frames: int = 0
    quanta: int = 0  # pause time of the last frame: 0 means resume (XON)
    quanta_max: int = 0


URGENT_PPS = 100.0


class PfcSniffer(Collector):
    """PFC frames on one interface, per source MAC and priority, counted by a reader thread.

    The socket opens in the constructor, in the calling thread's network
    namespace; ``close()`` stops the thread and closes it.
    """

    name: ClassVar[str] = "pfc_sniffer"
    # Four readings a second: a storm must outlast a one-second detection window
    # before it is called one, and a half-second burst must visibly not.
    interval: float = 0.25

    def __init__(
        self,
        iface: str,
        direction: Direction = "both",
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if direction not in ("both", "rx", "tx"):
            raise ValueError(f"direction must be both, rx or tx, not {direction!r}")
        self.iface = iface
        self.direction = direction
        self.clock = clock
        self._lock = threading.Lock()
        self._interval: dict[tuple[str, int, str], _Tally] = {}
        self._totals: dict[int, int] = {}  # priority -> frames since start
        self._last_collect = clock()
        self._stop = threading.Event()
        self._sock = self._open(iface)
        self._thread = threading.Thread(
            target=self._read_loop, name=f"pfc-sniffer-{iface}", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _open(iface: str) -> socket.socket:
        # Protocol 0 until the filter is attached, so no unfiltered frame slips in.
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        try:
            _attach_pfc_filter(sock)
            sock.bind((iface, ETH_P_ALL))
            sock.settimeout(0.2)  # lets the thread notice close() promptly
        except OSError:
            sock.close()
            raise
        return sock

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            try:
                data, address = self._sock.recvfrom(2048)
            except TimeoutError:
                continue
            except OSError:
                if not self._stop.is_set():
                    log.exception("pfc_sniffer: reading %s failed", self.iface)
                return
            self.count_frame(data, outgoing=address[2] == PACKET_OUTGOING)

    def count_frame(self, data: bytes, outgoing: bool) -> None:
        """Count one received frame (the reader thread calls this for every frame)."""
        direction = "tx" if outgoing else "rx"
        if self.direction != "both" and direction != self.direction:
            return
        frame = parse_pfc_frame(data)
        if frame is None:
            return
        with self._lock:
            for priority in frame.priorities:
                tally = self._interval.setdefault((frame.src_mac, priority, direction), _Tally())
                tally.frames += 1
                tally.quanta = frame.quanta[priority]
                tally.quanta_max = max(tally.quanta_max, tally.quanta)
                self._totals[priority] = self._totals.get(priority, 0) + 1

    def totals(self) -> dict[int, int]:
        """Frames seen per priority since the sniffer started."""
        with self._lock:
            return dict(self._totals)

    async def collect(self) -> Samples:
        """Counters per priority (value: frames since start) and one event per sender."""
        now = self.clock()
        ts = datetime.now(UTC)
        with self._lock:
            interval, self._interval = self._interval, {}
            totals = dict(self._totals)
        elapsed = now - self._last_collect
        self._last_collect = now

        per_priority: dict[int, int] = {}
        for (_, priority, _), tally in interval.items():
            per_priority[priority] = per_priority.get(priority, 0) + tally.frames

        samples = Samples()
        # Pausing at this rate is either a storm building or heavy congestion:
        # either way the backend should see it now, not at the next batch tick.
        samples.urgent = any(
            elapsed > 0 and frames / elapsed >= URGENT_PPS for frames in per_priority.values()
        )
        for priority in sorted(totals):
            frames = per_priority.get(priority, 0)
            samples.nics.append(
                NicCounter(
                    ts=ts,
                    iface=self.iface,
                    counter=f"pfc_frames_prio{priority}",
                    value=totals[priority],
                    # Counting began at zero when the sniffer opened, so even the
                    # first interval has an honest rate.
                    rate=frames / elapsed if elapsed > 0 else None,
                )
            )
        for (src_mac, priority, direction), tally in sorted(interval.items()):
            samples.events.append(
                Event(
                    ts=ts,
                    kind="pfc_frames",
                    severity="warning",
                    message=(
                        f"{tally.frames} PFC frames for priority {priority} from {src_mac} "
                        f"({direction}) on {self.iface}"
                    ),
                    attrs={
                        "iface": self.iface,
                        "src_mac": src_mac,
                        "priority": priority,
                        "frames": tally.frames,
                        "quanta": tally.quanta,
                        "quanta_max": tally.quanta_max,
                        "direction": direction,
                        "interval_s": round(elapsed, 3),
                    },
                )
            )
        return samples

    async def close(self) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the reader thread and close the socket (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._sock.close()

