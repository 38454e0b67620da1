"""The ping-mesh prober: one UDP probe per peer per flow per interval.

Each flow is its own UDP socket, so its own source port: switches hash the
5-tuple to pick an ECMP path, and F flows to a peer take (up to) F paths. A
path that drops or delays packets then shows as loss or latency on some flows
to many peers while the other flows stay clean, which is what lets the
backend blame a link rather than a node.

RTT is taken from the kernel's receive timestamp (SO_TIMESTAMPNS) minus the
send time read just before ``sendto``, so time the agent's event loop spends
on other work between the datagram's arrival and its reading is not counted.
The same kernel time decides whether a reply beat the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import secrets
import socket
import statistics
import time
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from agents.probes.responder import (
    ANCILLARY_SIZE,
    address_family,
    decode_reply,
    enable_kernel_timestamps,
    encode_probe,
    kernel_timestamp_ns,
    serve_many,
)
from agents.protocol import Peer, ProbeStat

log = logging.getLogger(__name__)

_SOCKET_RCVBUF = 1024 * 1024
_MAX_COMPLETED_SECONDS = 600  # undrained seconds kept before the oldest are dropped
_SEND_AHEAD_S = 0.0005  # sends due this soon go out now instead of arming a timer
# A kernel timestamp may trail the user-space clock reading by a little (the two
# clocks are read at different instants); beyond this it is not trusted.
_CLOCK_SLACK_NS = 100_000


@dataclass(slots=True)
class _Cell:
    """One (peer, flow) within one second."""

    sent: int = 0
    received: int = 0
    rtts_us: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Bucket:
    """The probes sent in one wall-clock second; complete once closed and nothing pending."""

    second: int
    cells: dict[tuple[str, int], _Cell] = field(default_factory=dict)
    pending: int = 0
    closed: bool = False


@dataclass(slots=True)
class _Pending:
    bucket: _Bucket
    cell: _Cell
    flow: int
    send_wall_ns: int
    send_mono_ns: int


@dataclass(frozen=True, slots=True)
class _Target:
    node: str
    sockaddr: tuple[Any, ...]
    order_key: int  # stable per (prober, peer): spreads each peer's probes over the second


class PingProber:
    """Probes every peer of a pinglist on ``flows`` UDP flows, once per ``interval``.

    Sends are spread evenly across each interval, in an order that differs
    from node to node and a phase that moves each round, so a peer is not hit
    by the whole cluster at the top of every second. ``drain()`` returns the
    finished per-second, per-(peer, flow) statistics.
    """

    def __init__(
        self,
        node: str,
        peers: list[Peer],
        flows: int = 4,
        dscp: int = 0,
        interval: float = 1.0,
        timeout: float = 1.0,
        bind_host: str = "0.0.0.0",
    ) -> None:
        if not 1 <= flows <= 256:
            raise ValueError("flows must be within 1..256")
        if not 0 <= dscp <= 63:
            raise ValueError("dscp must be within 0..63")
        if not 0.01 <= interval <= 60:
            raise ValueError("interval must be within 0.01..60 s")
        if not 0.001 <= timeout <= 60:
            raise ValueError("timeout must be within 0.001..60 s")
        self.node = node
        self.flows = flows
        self.dscp = dscp
        self.interval = interval
        self.timeout = timeout
        self.bind_host = bind_host
        self._family = address_family(bind_host)
        self._timeout_ns = int(timeout * 1e9)
        # Replies from an earlier run of this agent (same ports, same seqs)
        # carry another token and are ignored.
        self._token = secrets.randbits(64)
        self._seq = 0
        self._targets: dict[str, _Target] = {}
        self._socks: list[socket.socket] = []
        self._kernel_stamps: list[bool] = []
        self._pending: dict[int, _Pending] = {}
        self._expiry: deque[tuple[int, int]] = deque()  # (deadline mono ns, seq), send order
        self._bucket: _Bucket | None = None
        self._completed: deque[_Bucket] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.probes_sent = 0
        self.replies_received = 0
        self.probes_lost = 0
        self.late_replies = 0  # matched a probe already judged lost: not counted as received
        self.foreign_datagrams = 0  # malformed, another prober's, or a flow mismatch
        self.send_errors = 0
        self.kernel_timed_replies = 0  # RTT taken from the kernel stamp, not user space
        self.dropped_seconds = 0  # completed seconds discarded because nobody drained them
        self.set_peers(peers)

    # -- pinglist ---------------------------------------------------------------

    def set_peers(self, peers: Iterable[Peer]) -> None:
        """Replace the pinglist. Takes effect from the next send; no restart, no lost stats.

        Addresses are expected to be IP literals (the data-fabric address a
        node registers); a name is resolved here, once, and a peer whose name
        does not resolve is skipped with a warning.
        """
        targets: dict[str, _Target] = {}
        for peer in peers:
            sockaddr = self._resolve(peer)
            if sockaddr is None:
                continue
            key = zlib.crc32(f"{self.node}>{peer.node}".encode())
            targets[peer.node] = _Target(peer.node, sockaddr, key)
        self._targets = targets

    @property
    def peers(self) -> list[str]:
        return sorted(self._targets)

    def _resolve(self, peer: Peer) -> tuple[Any, ...] | None:
        for flags in (socket.AI_NUMERICHOST, 0):
            try:
                infos = socket.getaddrinfo(
                    peer.address, peer.port, self._family, socket.SOCK_DGRAM, 0, flags
                )
            except socket.gaierror:
                continue
            if infos:
                return infos[0][4]
        log.warning("ping-mesh peer %s: cannot resolve %r; skipped", peer.node, peer.address)
        return None

    # -- lifecycle --------------------------------------------------------------

    @property
    def running(self) -> bool:
        return bool(self._tasks)

    @property
    def flow_ports(self) -> list[int]:
        """The UDP source port of each flow, by flow index."""
        return [int(s.getsockname()[1]) for s in self._socks]

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        """The flow sockets, by flow index (for inspection; do not read from them)."""
        return tuple(self._socks)

    @property
    def kernel_timestamps(self) -> bool:
        """True when every flow gets (or, once stopped, got) kernel receive timestamps."""
        return bool(self._kernel_stamps) and all(self._kernel_stamps)

    async def start(self) -> None:
        """Open one socket per flow and start probing. Calling it twice is harmless."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._kernel_stamps = []
        try:
            for flow in range(self.flows):
                self._socks.append(self._open_flow_socket())
                self._kernel_stamps.append(enable_kernel_timestamps(self._socks[-1]))
                loop.add_reader(self._socks[-1].fileno(), self._read_replies, flow)
        except BaseException:
            self._close_sockets()
            raise
        self._tasks = [
            asyncio.create_task(self._send_loop(), name="pingmesh-send"),
            asyncio.create_task(self._expire_loop(), name="pingmesh-expire"),
        ]
        log.info(
            "ping-mesh prober %s: %d peers x %d flows (ports %s), dscp %d",
            self.node,
            len(self._targets),
            self.flows,
            self.flow_ports,
            self.dscp,
        )

    async def stop(self) -> None:
        """Stop probing and close the sockets.

        Seconds still waiting on replies are discarded rather than reported
        with their pending probes as lost, which would be a false alarm.
        """
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._close_sockets()
        self._pending.clear()
        self._expiry.clear()
        self._bucket = None

    def _open_flow_socket(self) -> socket.socket:
        sock = socket.socket(self._family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_RCVBUF)
            # DSCP sits in the upper six bits of the TOS / traffic-class byte;
            # the low two are ECN and stay 0.
            if self._family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, self.dscp << 2)
            else:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, self.dscp << 2)
            sock.bind((self.bind_host, 0))  # distinct ephemeral port per flow
        except BaseException:
            sock.close()
            raise
        return sock

    def _close_sockets(self) -> None:
        for sock in self._socks:
            if self._loop is not None and not self._loop.is_closed():
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(sock.fileno())
            sock.close()
        self._socks = []

    # -- results ----------------------------------------------------------------

    def drain(self) -> list[ProbeStat]:
        """The per-second, per-(peer, flow) stats completed since the last drain."""
        out: list[ProbeStat] = []
        while self._completed:
            bucket = self._completed.popleft()
            ts = datetime.fromtimestamp(bucket.second, tz=UTC)
            for (peer, flow), cell in bucket.cells.items():
                rtts = cell.rtts_us
                out.append(
                    ProbeStat(
                        ts=ts,
                        peer=peer,
                        flow=flow,
                        sent=cell.sent,
                        received=cell.received,
                        rtt_min_us=round(min(rtts), 1) if rtts else None,
                        rtt_p50_us=round(statistics.median(rtts), 1) if rtts else None,
                        rtt_max_us=round(max(rtts), 1) if rtts else None,
                    )
                )
        return out

    def _settle(self, bucket: _Bucket) -> None:
        if bucket.closed and bucket.pending == 0:
            self._completed.append(bucket)
            if len(self._completed) > _MAX_COMPLETED_SECONDS:
                self._completed.popleft()
                self.dropped_seconds += 1

    def _close_bucket(self) -> None:
        if self._bucket is not None:
            self._bucket.closed = True
            self._settle(self._bucket)
            self._bucket = None

    # -- sending ----------------------------------------------------------------

    async def _send_loop(self) -> None:
        loop = asyncio.get_running_loop()
        round_index: int | None = None
        while True:
            wall = time.time()
            # Rounds start on multiples of the interval in wall-clock time, so
            # every node's seconds line up in the backend. After a stall longer
            # than a round, or a clock step, skip to the next boundary.
            if round_index is None or not (
                wall - self.interval <= round_index * self.interval <= wall + 2 * self.interval
            ):
                round_index = math.ceil(wall / self.interval)
            round_start_wall = round_index * self.interval
            round_start = loop.time() + (round_start_wall - wall)
            delay = round_start - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            second = math.floor(round_start_wall + 1e-6)
            if self._bucket is None or self._bucket.second != second:
                self._close_bucket()
                self._bucket = _Bucket(second)
            bucket = self._bucket
            await self._send_round(loop, round_start, bucket)
            round_index += 1
            if math.floor(round_index * self.interval + 1e-6) != second:
                self._close_bucket()  # no more sends into this second

    async def _send_round(
        self, loop: asyncio.AbstractEventLoop, round_start: float, bucket: _Bucket
    ) -> None:
        targets = sorted(self._targets.values(), key=lambda t: t.order_key)
        if not targets:
            return
        phase = random.random()  # jitter: the schedule slides a little every round
        spacing = self.interval / len(targets)
        for i, target in enumerate(targets):
            delay = round_start + (i + phase) * spacing - loop.time()
            if delay > _SEND_AHEAD_S:
                await asyncio.sleep(delay)
            if self._targets.get(target.node) is not target:
                continue  # removed (or re-addressed) by set_peers since the round began
            self._send_target(target, bucket)

    def _send_target(self, target: _Target, bucket: _Bucket) -> None:
        for flow, sock in enumerate(self._socks):
            key = (target.node, flow)
            cell = bucket.cells.get(key)
            if cell is None:
                cell = bucket.cells[key] = _Cell()
            self._seq = (self._seq + 1) & 0xFFFF_FFFF_FFFF_FFFF
            seq = self._seq
            send_wall_ns = time.time_ns()
            send_mono_ns = time.monotonic_ns()
            cell.sent += 1
            self.probes_sent += 1
            try:
                sock.sendto(encode_probe(flow, self._token, seq, send_wall_ns), target.sockaddr)
            except OSError as exc:
                # It never left this host (no route, buffer full, firewall):
                # from the mesh's point of view the probe is lost.
                self.send_errors += 1
                self.probes_lost += 1
                if self.send_errors == 1 or self.send_errors % 1000 == 0:
                    log.warning("ping-mesh send to %s failed: %s", target.node, exc)
                continue
            self._pending[seq] = _Pending(bucket, cell, flow, send_wall_ns, send_mono_ns)
            self._expiry.append((send_mono_ns + self._timeout_ns, seq))
            bucket.pending += 1

    # -- receiving --------------------------------------------------------------

    def _read_replies(self, flow: int) -> None:
        sock = self._socks[flow]
        kernel_stamps = self._kernel_stamps[flow]
        while True:
            try:
                if kernel_stamps:
                    data, ancdata, _flags, _addr = sock.recvmsg(256, ANCILLARY_SIZE)
                    kernel_ns = kernel_timestamp_ns(ancdata)
                else:
                    data, _addr = sock.recvfrom(256)
                    kernel_ns = None
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. a queued ICMP error; the next readable event resumes
            user_mono_ns = time.monotonic_ns()
            reply = decode_reply(data)
            if reply is None:
                self.foreign_datagrams += 1
                continue
            reply_flow, token, seq, send_ns, _responder_rx_ns = reply
            pending = self._pending.get(seq)
            if token != self._token or reply_flow != flow:
                self.foreign_datagrams += 1
                continue
            if pending is None or pending.send_wall_ns != send_ns or pending.flow != flow:
                self.late_replies += 1  # its probe was already judged lost
                continue
            del self._pending[seq]
            rtt_ns, kernel_timed = self._rtt_ns(pending, kernel_ns, user_mono_ns)
            if rtt_ns > self._timeout_ns:
                self.late_replies += 1
                self._judge_lost(pending)
                continue
            self.replies_received += 1
            self.kernel_timed_replies += kernel_timed
            pending.cell.received += 1
            pending.cell.rtts_us.append(rtt_ns / 1000)
            pending.bucket.pending -= 1
            self._settle(pending.bucket)

    @staticmethod
    def _rtt_ns(pending: _Pending, kernel_ns: int | None, user_mono_ns: int) -> tuple[int, bool]:
        """The RTT and whether it came from the kernel's receive stamp."""
        user_rtt = user_mono_ns - pending.send_mono_ns
        if kernel_ns is not None:
            kernel_rtt = kernel_ns - pending.send_wall_ns
            # The kernel stamp uses the wall clock; if it was stepped between
            # send and receive the difference is nonsense, and the monotonic
            # user-space figure (an upper bound) is the honest one.
            if 0 < kernel_rtt <= user_rtt + _CLOCK_SLACK_NS:
                return kernel_rtt, True
        return max(user_rtt, 1), False

    # -- loss -------------------------------------------------------------------

    async def _expire_loop(self) -> None:
        period = min(max(self.timeout / 10, 0.01), 0.1)
        while True:
            await asyncio.sleep(period)
            self._expire()

    def _expire(self) -> None:
        # Replies already in the socket buffers are read first: one that the
        # kernel received in time counts even if the loop was busy until now.
        for flow in range(len(self._socks)):
            self._read_replies(flow)
        now = time.monotonic_ns()
        while self._expiry and self._expiry[0][0] <= now:
            _deadline, seq = self._expiry.popleft()
            pending = self._pending.pop(seq, None)
            if pending is not None:
                self._judge_lost(pending)

    def _judge_lost(self, pending: _Pending) -> None:
        self.probes_lost += 1
        pending.bucket.pending -= 1
        self._settle(pending.bucket)


def measure_overhead(
    peers: int = 64, seconds: float = 30.0, flows: int = 4, host: str = "127.0.0.1"
) -> dict[str, Any]:
    """Run one prober against ``peers`` loopback responders and measure its cost.

    The responders run in a child process so that only the prober's CPU and
    memory are counted. Returns CPU % of one core and RSS of this process,
    with the probe totals. Blocking: it runs its own event loop.
    """
    import multiprocessing

    import psutil

    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=serve_many, args=(host, peers, child_end), daemon=True)
    child.start()
    try:
        if not parent_end.poll(60):
            raise RuntimeError("responders did not start")
        ports: list[int] = parent_end.recv()
        peer_list = [Peer(node=f"peer-{i}", address=host, port=p) for i, p in enumerate(ports)]
        return asyncio.run(_measure(peer_list, seconds, flows, psutil.Process()))
    finally:
        child.terminate()
        child.join(10)


async def _measure(
    peer_list: list[Peer], seconds: float, flows: int, me: Any
) -> dict[str, Any]:
    prober = PingProber("bench", peer_list, flows=flows)
    rss_before = me.memory_info().rss
    await prober.start()
    rows = 0
    p50s: list[float] = []  # the rows themselves are not kept: that memory is the shipper's
    cpu_start = me.cpu_times()
    wall_start = time.monotonic()
    try:
        while time.monotonic() - wall_start < seconds:
            await asyncio.sleep(1.0)
            drained = prober.drain()
            rows += len(drained)
            p50s.extend(s.rtt_p50_us for s in drained if s.rtt_p50_us is not None)
        cpu_end = me.cpu_times()
        wall = time.monotonic() - wall_start
        rss_after = me.memory_info().rss
        kernel_timestamps = prober.kernel_timestamps
    finally:
        await prober.stop()
    cpu_s = (cpu_end.user - cpu_start.user) + (cpu_end.system - cpu_start.system)
    return {
        "peers": len(peer_list),
        "flows": flows,
        "seconds": round(wall, 2),
        "cpu_pct": round(100 * cpu_s / wall, 2),
        "rss_mib": round(rss_after / 2**20, 1),
        "rss_growth_mib": round((rss_after - rss_before) / 2**20, 1),
        "probes_sent": prober.probes_sent,
        "replies_received": prober.replies_received,
        "probes_lost": prober.probes_lost,
        "late_replies": prober.late_replies,
        "stats_rows": rows,
        "rtt_p50_us": round(statistics.median(p50s), 1) if p50s else None,
        "kernel_timestamps": kernel_timestamps,
    }
