"""The ping-mesh echo responder and the probe wire format.

Every node runs one ``UdpEchoResponder``; the ``PingProber`` of every other
node sends it probes and times the echoes. The wire format lives here because
the responder is the side that must never misread it: a probe is echoed, and
everything else (junk, truncated datagrams, other responders' replies) is
dropped without an answer, so two responders can never ping-pong.

Probe (32 bytes, network byte order)::

    magic "MWP1" | kind=1 u8 | pad u8 | flow u16 | token u64 | seq u64 | send_ns u64

Reply (40 bytes): the probe's 32 bytes with kind=2, then the responder's
receive time (ns since the epoch, from the kernel where it can say).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
import threading
import time
from collections import OrderedDict

log = logging.getLogger(__name__)

DEFAULT_PROBE_PORT = 7447

MAGIC = b"MWP1"
KIND_PROBE = 1
KIND_REPLY = 2
PROBE_FORMAT = struct.Struct("!4sBxHQQQ")  # magic, kind, flow, token, seq, send_ns
REPLY_TAIL = struct.Struct("!Q")  # responder receive time, ns
PROBE_SIZE = PROBE_FORMAT.size
REPLY_SIZE = PROBE_SIZE + REPLY_TAIL.size

# SO_TIMESTAMPNS is missing from Python's socket module; 35 is its value in
# asm-generic (x86_64, aarch64, ...). With it the kernel stamps each datagram
# as it is received, so a busy process does not inflate what it measures.
SO_TIMESTAMPNS = 35 if sys.platform.startswith("linux") else None
_TIMESPEC = struct.Struct("@qq")  # struct timespec on 64-bit Linux
ANCILLARY_SIZE = socket.CMSG_SPACE(_TIMESPEC.size) if hasattr(socket, "CMSG_SPACE") else 0
# Room for the timestamp and the probe's TOS / traffic class (an int at most).
_RESPONDER_ANCILLARY_SIZE = ANCILLARY_SIZE + socket.CMSG_SPACE(4) if ANCILLARY_SIZE else 0

_RECV_BUFFER = 2048  # larger than any probe: oversize junk is read whole and dropped
_SOCKET_RCVBUF = 4 * 1024 * 1024  # rides out bursts (and junk floods) without drops
_MAX_TRACKED_SOURCES = 4096


def encode_probe(flow: int, token: int, seq: int, send_ns: int) -> bytes:
    """The bytes of one probe."""
    return PROBE_FORMAT.pack(MAGIC, KIND_PROBE, flow, token, seq, send_ns)


def make_reply(datagram: bytes, rx_ns: int) -> bytes | None:
    """The echo for ``datagram``, or None when it is not a well-formed probe."""
    if len(datagram) != PROBE_SIZE:
        return None
    magic, kind, flow, token, seq, send_ns = PROBE_FORMAT.unpack(datagram)
    if magic != MAGIC or kind != KIND_PROBE:
        return None
    header = PROBE_FORMAT.pack(MAGIC, KIND_REPLY, flow, token, seq, send_ns)
    return header + REPLY_TAIL.pack(rx_ns)


def decode_reply(datagram: bytes) -> tuple[int, int, int, int, int] | None:
    """``(flow, token, seq, send_ns, responder_rx_ns)`` of a reply, or None if malformed."""
    if len(datagram) != REPLY_SIZE:
        return None
    magic, kind, flow, token, seq, send_ns = PROBE_FORMAT.unpack_from(datagram)
    if magic != MAGIC or kind != KIND_REPLY:
        return None
    (rx_ns,) = REPLY_TAIL.unpack_from(datagram, PROBE_SIZE)
    return flow, token, seq, send_ns, rx_ns


def enable_kernel_timestamps(sock: socket.socket) -> bool:
    """Ask the kernel to stamp received datagrams; False where it cannot."""
    if SO_TIMESTAMPNS is None or not ANCILLARY_SIZE:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def kernel_timestamp_ns(ancdata: list[tuple[int, int, bytes]]) -> int | None:
    """The SO_TIMESTAMPNS receive time (ns since the epoch) in recvmsg's ancillary data."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            return sec * 1_000_000_000 + nsec
    return None


def probe_tos(ancdata: list[tuple[int, int, bytes]]) -> int:
    """The TOS (IPv4) or traffic class (IPv6) byte a datagram arrived with; 0 if not reported."""
    for level, kind, data in ancdata:
        if level == socket.IPPROTO_IP and kind == socket.IP_TOS and data:
            return data[0]
        if level == socket.IPPROTO_IPV6 and kind == socket.IPV6_TCLASS and len(data) >= 4:
            return int.from_bytes(data[:4], sys.byteorder) & 0xFF
    return 0


def address_family(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal, else AF_INET."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class UdpEchoResponder:
    """Echoes ping-mesh probes back to their sender, stamped with the receive time.

    The echo leaves with the probe's own DSCP, so when probes ride the RDMA
    traffic class the return path is measured in that class too.

    It runs on a dedicated thread blocked in ``recvmsg`` on its own socket
    rather than as an asyncio ``DatagramProtocol``. The agent's event loop
    also runs collectors, the shipper and NVML calls, any of which can hold
    it for milliseconds to seconds; an echo queued behind them would add that
    time to every peer's RTT and, past the peers' timeout, show this healthy
    node as lossy. A thread blocked in a system call wakes as soon as a
    datagram lands and needs the GIL only for the few microseconds it takes
    to check and send the echo, whatever the loop is doing (and whether the
    backend is reachable or not).
    """

    def __init__(self, host: str = "0.0.0.0", port: int = DEFAULT_PROBE_PORT) -> None:
        self.host = host
        self._requested_port = port
        self._bound_port = port
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._sources: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.answered = 0
        self.ignored = 0
        self.kernel_timestamps = False
        self._reflect_tos = False

    @property
    def port(self) -> int:
        """The bound UDP port (the one the kernel chose when 0 was asked for)."""
        return self._bound_port

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        """Bind the socket and start answering. Calling it twice is harmless."""
        if self.running:
            return
        sock = socket.socket(address_family(self.host), socket.SOCK_DGRAM)
        try:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_RCVBUF)
            except OSError:
                pass  # the kernel caps it at rmem_max; the default still works
            self.kernel_timestamps = enable_kernel_timestamps(sock)
            self._reflect_tos = self._enable_tos_reports(sock)
            sock.bind((self.host, self._requested_port))
            self._bound_port = int(sock.getsockname()[1])
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), name=f"meshwatch-responder-{self.port}", daemon=True
        )
        self._thread.start()
        log.info("ping-mesh responder on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        """Stop answering and release the port."""
        thread, sock = self._thread, self._sock
        if thread is None or sock is None:
            return
        self._stopping.set()
        try:
            # On Linux this wakes a thread blocked in recvmsg even on an
            # unconnected UDP socket (then reports ENOTCONN, which is expected).
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        await asyncio.to_thread(thread.join, 5.0)
        sock.close()
        self._thread = None

    @staticmethod
    def _enable_tos_reports(sock: socket.socket) -> bool:
        if not _RESPONDER_ANCILLARY_SIZE:
            return False
        try:
            if sock.family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS, 1)
            else:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        except (OSError, AttributeError):
            return False
        return True

    def sources(self) -> dict[tuple[str, int], int]:
        """Probes answered per sender (address, port): the most recent senders, bounded."""
        with self._lock:
            return dict(self._sources)

    def _note_source(self, addr: tuple[str, int]) -> None:
        key = (addr[0], addr[1])
        with self._lock:
            self._sources[key] = self._sources.get(key, 0) + 1
            self._sources.move_to_end(key)
            if len(self._sources) > _MAX_TRACKED_SOURCES:
                self._sources.popitem(last=False)

    def _serve(self, sock: socket.socket) -> None:
        use_recvmsg = self.kernel_timestamps or self._reflect_tos
        tos_level, tos_type = (
            (socket.IPPROTO_IPV6, socket.IPV6_TCLASS)
            if sock.family == socket.AF_INET6
            else (socket.IPPROTO_IP, socket.IP_TOS)
        )
        while not self._stopping.is_set():
            tos = 0
            try:
                if use_recvmsg:
                    data, ancdata, _flags, addr = sock.recvmsg(
                        _RECV_BUFFER, _RESPONDER_ANCILLARY_SIZE
                    )
                    rx_ns = kernel_timestamp_ns(ancdata) or time.time_ns()
                    tos = probe_tos(ancdata) & 0xFC  # DSCP only: a CE mark is not echoed
                else:
                    data, addr = sock.recvfrom(_RECV_BUFFER)
                    rx_ns = time.time_ns()
            except OSError:
                if self._stopping.is_set():
                    return
                continue  # a transient error must not silence the node
            if not data and self._stopping.is_set():
                return
            try:
                reply = make_reply(data, rx_ns)
                if reply is None:
                    self.ignored += 1
                    continue
                if tos:
                    tos_data = (
                        tos.to_bytes(4, sys.byteorder)
                        if tos_level == socket.IPPROTO_IPV6
                        else bytes([tos])
                    )
                    sock.sendmsg([reply], [(tos_level, tos_type, tos_data)], 0, addr)
                else:
                    sock.sendto(reply, addr)
                self.answered += 1
                self._note_source(addr)
            except Exception:  # noqa: BLE001 - nothing a sender does may stop the echo
                self.ignored += 1
                log.debug("echo to %s failed", addr, exc_info=True)


def serve_many(host: str, count: int, ready: object) -> None:
    """Run ``count`` responders on ephemeral ports until the process is killed.

    Sends the list of ports through ``ready`` (a multiprocessing Connection).
    Used to give the prober's overhead benchmark its peers in another process,
    so their CPU is not counted as the prober's.
    """

    async def main() -> None:
        responders = [UdpEchoResponder(host, 0) for _ in range(count)]
        for responder in responders:
            await responder.start()
        ready.send([r.port for r in responders])  # type: ignore[attr-defined]
        await asyncio.Event().wait()

    asyncio.run(main())
