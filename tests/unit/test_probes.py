"""Ping-mesh responder, prober and collector over real UDP sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import math
import random
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable

import pytest

from agents.collectors.pingmesh import PingmeshCollector
from agents.probes.prober import PingProber, measure_overhead
from agents.probes.responder import (
    KIND_REPLY,
    MAGIC,
    PROBE_FORMAT,
    UdpEchoResponder,
    decode_reply,
    encode_probe,
    make_reply,
)
from agents.protocol import Peer, ProbeStat

LOOPBACK = "127.0.0.1"
# Short rounds keep the tests quick; stats are still per wall-clock second.
INTERVAL = 0.2
TIMEOUT = 0.5


async def wait_until(condition: Callable[[], bool], deadline_s: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail the test if it does not within the deadline."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {deadline_s} s")
        await asyncio.sleep(0.02)


class StatLog:
    """Keeps everything a prober has drained, so conditions can look back over it."""

    def __init__(self, prober: PingProber) -> None:
        self.prober = prober
        self.rows: list[ProbeStat] = []

    def pull(self) -> list[ProbeStat]:
        self.rows.extend(self.prober.drain())
        return self.rows

    def for_peer(self, peer: str) -> list[ProbeStat]:
        return [r for r in self.pull() if r.peer == peer]


def unused_udp_port() -> int:
    """A port nothing listens on: bound by the kernel's choice, then released."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def responder() -> AsyncIterator[UdpEchoResponder]:
    r = UdpEchoResponder(LOOPBACK, 0)
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


def peer_of(name: str, r: UdpEchoResponder) -> Peer:
    return Peer(node=name, address=LOOPBACK, port=r.port)


async def running_prober(peers: list[Peer], **kwargs: object) -> PingProber:
    options: dict = {"interval": INTERVAL, "timeout": TIMEOUT, "bind_host": LOOPBACK}
    options.update(kwargs)
    prober = PingProber("node-a", peers, **options)
    await prober.start()
    return prober


async def test_rtt_recorded_on_every_flow_and_plausible(responder: UdpEchoResponder) -> None:
    prober = await running_prober([peer_of("node-b", responder)])
    log = StatLog(prober)
    try:
        await wait_until(
            lambda: {r.flow for r in log.for_peer("node-b") if r.received > 0} == {0, 1, 2, 3}
        )
    finally:
        await prober.stop()
    answered = [r for r in log.rows if r.received > 0]
    for row in answered:
        assert row.sent >= row.received
        assert row.rtt_min_us is not None and row.rtt_p50_us is not None
        assert row.rtt_max_us is not None
        assert 0 < row.rtt_min_us <= row.rtt_p50_us <= row.rtt_max_us < TIMEOUT * 1e6
        assert row.ts.microsecond == 0  # stats are per wall-clock second
    if sys.platform.startswith("linux"):
        assert prober.kernel_timestamps
        assert prober.kernel_timed_replies == prober.replies_received > 0


async def test_four_flows_reach_the_responder_from_four_source_ports(
    responder: UdpEchoResponder,
) -> None:
    prober = await running_prober([peer_of("node-b", responder)], flows=4)
    try:
        ports = prober.flow_ports
        await wait_until(lambda: {p for h, p in responder.sources() if h == LOOPBACK} >= set(ports))
    finally:
        await prober.stop()
    assert len(set(ports)) == 4
    seen = {p for h, p in responder.sources() if h == LOOPBACK}
    assert seen == set(ports)


async def test_stopped_responder_gives_sent_without_received() -> None:
    responder = UdpEchoResponder(LOOPBACK, 0)
    await responder.start()
    prober = await running_prober([peer_of("node-b", responder)])
    log = StatLog(prober)
    try:
        await wait_until(lambda: any(r.received > 0 for r in log.for_peer("node-b")))
        await responder.stop()
        # Seconds that begin after the stop hold only unanswered probes.
        after = math.ceil(time.time())
        silent = lambda: [r for r in log.for_peer("node-b") if r.ts.timestamp() >= after]  # noqa: E731
        await wait_until(lambda: {r.flow for r in silent()} == {0, 1, 2, 3})
    finally:
        await prober.stop()
        await responder.stop()
    for row in silent():
        assert row.sent > 0
        assert row.received == 0
        assert row.rtt_min_us is None and row.rtt_p50_us is None and row.rtt_max_us is None
    assert prober.probes_lost > 0


async def test_port_with_no_listener_counts_every_probe_lost(
    responder: UdpEchoResponder,
) -> None:
    dead = Peer(node="node-dead", address=LOOPBACK, port=unused_udp_port())
    prober = await running_prober([dead, peer_of("node-b", responder)])
    log = StatLog(prober)
    try:
        await wait_until(lambda: len({r.ts for r in log.for_peer("node-dead")}) >= 2)
    finally:
        await prober.stop()
    dead_rows = log.for_peer("node-dead")
    assert all(r.sent > 0 and r.received == 0 for r in dead_rows)
    # The live peer in the same seconds was answered: the loss is the peer's, not the prober's.
    live_seconds = {r.ts for r in log.for_peer("node-b") if r.received > 0}
    assert live_seconds & {r.ts for r in dead_rows}


async def test_dscp_is_set_on_the_sockets_and_on_the_wire() -> None:
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind((LOOPBACK, 0))
    receiver.setblocking(False)
    receiver.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    peer = Peer(node="node-b", address=LOOPBACK, port=receiver.getsockname()[1])
    prober = await running_prober([peer], dscp=46, flows=2)  # EF
    tos_seen: list[int] = []

    def received_tos() -> bool:
        try:
            _data, ancdata, _flags, _addr = receiver.recvmsg(256, socket.CMSG_SPACE(4))
        except BlockingIOError:
            return False
        for level, kind, value in ancdata:
            if level == socket.IPPROTO_IP and kind == socket.IP_TOS:
                tos_seen.append(value[0])
        return bool(tos_seen)

    try:
        for sock in prober.sockets:
            assert sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 46 << 2
        await wait_until(received_tos)
    finally:
        await prober.stop()
        receiver.close()
    assert tos_seen[0] == 184


async def test_responder_answers_in_the_probes_traffic_class(
    responder: UdpEchoResponder,
) -> None:
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.bind((LOOPBACK, 0))
    client.setblocking(False)
    client.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    replies: list[tuple[bytes, int]] = []

    def got_reply() -> bool:
        try:
            data, ancdata, _flags, _addr = client.recvmsg(256, socket.CMSG_SPACE(4))
        except BlockingIOError:
            return False
        ip_tos = (socket.IPPROTO_IP, socket.IP_TOS)
        tos = [value[0] for level, kind, value in ancdata if (level, kind) == ip_tos]
        replies.append((data, tos[0] if tos else -1))
        return True

    try:
        for seq, tos in ((1, 26 << 2), (2, 0)):  # DSCP 26 (an RDMA class), then best effort
            client.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
            client.sendto(encode_probe(0, 5, seq, time.time_ns()), (LOOPBACK, responder.port))
            await wait_until(got_reply)
    finally:
        client.close()
    assert [(decode_reply(data)[2], tos) for data, tos in replies] == [(1, 104), (2, 0)]


async def test_set_peers_adds_and_removes_peers_without_restart(
    responder: UdpEchoResponder,
) -> None:
    second = UdpEchoResponder(LOOPBACK, 0)
    await second.start()
    prober = await running_prober([peer_of("node-b", responder)])
    log = StatLog(prober)
    ports_before = prober.flow_ports
    try:
        await wait_until(lambda: any(r.received for r in log.for_peer("node-b")))
        prober.set_peers([peer_of("node-b", responder), peer_of("node-c", second)])
        await wait_until(lambda: any(r.received for r in log.for_peer("node-c")))
        assert prober.peers == ["node-b", "node-c"]

        prober.set_peers([peer_of("node-c", second)])
        removed_at = math.ceil(time.time())

        def seconds_after_removal() -> set[str]:
            return {r.peer for r in log.pull() if r.ts.timestamp() >= removed_at}

        await wait_until(lambda: "node-c" in seconds_after_removal())
        assert prober.flow_ports == ports_before  # same sockets: no restart
    finally:
        await prober.stop()
        await second.stop()
    assert seconds_after_removal() == {"node-c"}
    assert all(r.received == r.sent for r in log.rows if r.peer == "node-c")


class DelayedEcho(asyncio.DatagramProtocol):
    """A peer whose echoes come back only after ``delay`` seconds (a congested path)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.transport: asyncio.DatagramTransport | None = None
        self.echoed = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = make_reply(data, time.time_ns())
        if reply is not None:
            asyncio.get_running_loop().call_later(self.delay, self._send, reply, addr)

    def _send(self, reply: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(reply, addr)
            self.echoed += 1


async def test_late_replies_are_not_counted_for_later_probes() -> None:
    loop = asyncio.get_running_loop()
    # Later than the timeout but, with rounds every 0.2 s, landing while the
    # next probes on the same flow are still outstanding.
    transport, slow = await loop.create_datagram_endpoint(
        lambda: DelayedEcho(delay=0.35), local_addr=(LOOPBACK, 0)
    )
    peer = Peer(node="node-slow", address=LOOPBACK, port=transport.get_extra_info("sockname")[1])
    prober = await running_prober([peer], timeout=0.2)
    log = StatLog(prober)
    try:
        await wait_until(
            lambda: prober.late_replies >= 8 and len({r.ts for r in log.for_peer("node-slow")}) >= 2
        )
    finally:
        await prober.stop()
        transport.close()
    assert slow.echoed >= 8
    assert prober.replies_received == 0
    assert all(r.sent > 0 and r.received == 0 for r in log.rows)


async def test_responder_ignores_a_junk_flood_and_keeps_answering(
    responder: UdpEchoResponder,
) -> None:
    rng = random.Random(7447)
    header = encode_probe(0, 1, 2, 3)
    crafted = [
        b"",
        header[:-1],  # truncated probe
        header + b"\x00",  # probe with a trailing byte
        PROBE_FORMAT.pack(MAGIC, KIND_REPLY, 0, 1, 2, 3) + bytes(8),  # a reply: never echoed
        PROBE_FORMAT.pack(MAGIC, 3, 0, 1, 2, 3),  # unknown kind
        PROBE_FORMAT.pack(b"XXXX", 1, 0, 1, 2, 3),  # wrong magic
    ]
    junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    junk.bind((LOOPBACK, 0))
    junk.setblocking(False)
    prober = await running_prober([peer_of("node-b", responder)])
    log = StatLog(prober)
    sent = 0
    try:
        for _burst in range(40):
            # Bursts small enough for the socket buffer, so every datagram is
            # seen by the responder rather than dropped by the kernel.
            for i in range(100):
                if i < len(crafted):
                    payload = crafted[i]
                else:
                    payload = rng.randbytes(rng.choice([1, 31, 33, 40, 64, 512, 1400]))
                junk.sendto(payload, (LOOPBACK, responder.port))
                sent += 1
            target = sent
            await wait_until(lambda: responder.ignored >= target)  # noqa: B023
        assert responder.ignored == sent

        # A marker probe after the flood: its echo must be the first thing the
        # junk socket gets back, proving none of the junk was answered.
        junk.sendto(encode_probe(0, 99, 12345, 1), (LOOPBACK, responder.port))
        replies: list[bytes] = []

        def got_reply() -> bool:
            try:
                replies.append(junk.recv(2048))
            except BlockingIOError:
                return False
            return True

        await wait_until(got_reply)
        flood_done = math.ceil(time.time())
        await wait_until(
            lambda: any(r.received and r.ts.timestamp() >= flood_done for r in log.pull())
        )
    finally:
        await prober.stop()
        junk.close()
    decoded = decode_reply(replies[0])
    assert decoded is not None and decoded[1:3] == (99, 12345)
    assert responder.running


async def test_pingmesh_collector_drains_the_prober(responder: UdpEchoResponder) -> None:
    own_responder = UdpEchoResponder(LOOPBACK, 0)
    prober = PingProber(
        "node-a",
        [peer_of("node-b", responder)],
        interval=INTERVAL,
        timeout=TIMEOUT,
        bind_host=LOOPBACK,
    )
    collector = PingmeshCollector(prober, own_responder)
    assert collector.name == "pingmesh"
    probes: list[ProbeStat] = []

    async def collect_once() -> None:
        probes.extend((await collector.collect()).probes)

    try:
        end = time.monotonic() + 10
        while not any(p.received for p in probes) and time.monotonic() < end:
            await collect_once()
            await asyncio.sleep(0.1)
        assert prober.running and own_responder.running
    finally:
        await collector.close()
    assert any(p.received for p in probes)
    assert all(isinstance(p, ProbeStat) and p.peer == "node-b" for p in probes)
    assert not prober.running and not own_responder.running


def test_prober_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        PingProber("a", [], dscp=64)
    with pytest.raises(ValueError):
        PingProber("a", [], flows=0)
    with pytest.raises(ValueError):
        PingProber("a", [], timeout=0)


def test_measure_overhead_reports_cpu_and_memory() -> None:
    result = measure_overhead(peers=2, seconds=2.0, flows=2)
    assert result["peers"] == 2 and result["flows"] == 2
    assert result["probes_sent"] > 0
    assert result["replies_received"] > 0
    assert result["cpu_pct"] >= 0
    assert result["rss_mib"] > 0
