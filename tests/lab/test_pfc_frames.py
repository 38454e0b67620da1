"""Real PFC frames through a real bridge: who sees them, counted per source MAC and priority.

Topology (all names "mwpfc*", addresses 198.18.250.0/24):

    netns mwpfc-a: mwpfc-a0 (198.18.250.1) ---- mwpfc-a1 --+
                                                           mwpfc-br (root netns)
    netns mwpfc-b: mwpfc-b0 (198.18.250.2) ---- mwpfc-b1 --+

Frames emitted in mwpfc-a are seen leaving mwpfc-a0 (tx) and arriving on the
bridge port mwpfc-a1 (rx), and never at mwpfc-b0: a bridge does not forward
01:80:c2:00:00:01.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agents.collectors.pfc_sniffer import PfcSniffer
from agents.pfc import build_pfc_frame, parse_pfc_frame

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2"),
]

REPO = Path(__file__).resolve().parents[2]
NS_A, NS_B, BRIDGE = "mwpfc-a", "mwpfc-b", "mwpfc-br"
A0, A1, B0, B1 = "mwpfc-a0", "mwpfc-a1", "mwpfc-b0", "mwpfc-b1"
ADDR_A, ADDR_B = "198.18.250.1", "198.18.250.2"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def teardown() -> None:
    for link in (A1, B1, BRIDGE):
        subprocess.run(["ip", "link", "del", link], capture_output=True)
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def leftovers() -> list[str]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [w for w in (links + spaces).split() if w.rstrip(":").startswith("mwpfc")]


@pytest.fixture
def lab() -> Iterator[None]:
    teardown()  # a run killed halfway may have left some behind
    try:
        ip("link", "add", BRIDGE, "type", "bridge")
        ip("link", "set", BRIDGE, "up")
        for ns, inner, outer, addr in ((NS_A, A0, A1, ADDR_A), (NS_B, B0, B1, ADDR_B)):
            ip("netns", "add", ns)
            ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
            ip("link", "set", outer, "master", BRIDGE)
            ip("link", "set", outer, "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
        yield
    finally:
        teardown()
        assert leftovers() == []


@contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Run the block in netns ``name``: sockets made there stay there afterwards."""
    with open(f"/var/run/netns/{name}") as target, open("/proc/thread-self/ns/net") as home:
        if _libc.setns(target.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
        try:
            yield
        finally:
            if _libc.setns(home.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back failed")


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def mac_of(ns: str, iface: str) -> str:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{iface}/address"],
        check=True, capture_output=True, text=True,
    )
    return out.stdout.strip()


def emit_from_a(*args: str) -> None:
    """Send PFC frames from netns A with the real emitter, as the lab does."""
    subprocess.run(
        ["ip", "netns", "exec", NS_A, sys.executable, "-m", "agents.pfc", A0, *args],
        check=True, capture_output=True, cwd=REPO, timeout=60,
    )


def test_frame_layout_is_802_1qbb() -> None:
    frame = build_pfc_frame("02:00:00:00:00:0a", {3: 0xFFFF, 5: 0})
    assert len(frame) == 60
    assert frame[:6] == bytes.fromhex("0180c2000001")
    assert frame[12:14] == b"\x88\x08" and frame[14:16] == b"\x01\x01"
    assert frame[16:18] == (0b00101000).to_bytes(2, "big")  # class-enable: priorities 3, 5
    parsed = parse_pfc_frame(frame)
    assert parsed is not None
    assert parsed.src_mac == "02:00:00:00:00:0a"
    assert parsed.priorities == [3, 5]
    assert parsed.quanta[3] == 0xFFFF and parsed.quanta[5] == 0


async def test_bridge_does_not_forward_pfc_and_sniffers_count_per_mac_and_priority(
    lab: None,
) -> None:
    with in_netns(NS_A):
        sniff_sender = PfcSniffer(A0)
        udp_a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with in_netns(NS_B):
        sniff_peer = PfcSniffer(B0)
        udp_b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp_b.bind((ADDR_B, 7450))
        udp_b.settimeout(10)
    sniff_bridge_port = PfcSniffer(A1, direction="rx")
    sniffers = (sniff_sender, sniff_bridge_port, sniff_peer)
    try:
        # The peer is reachable through the bridge: what it does not see was filtered.
        udp_a.sendto(b"hello", (ADDR_B, 7450))
        assert udp_b.recvfrom(64)[0] == b"hello"

        emit_from_a("--priority", "3", "--rate", "400", "--seconds", "0.5")
        emit_from_a("--priority", "5", "--rate", "200", "--seconds", "0.1",
                    "--quanta", "0x10", "--src-mac", "02:00:00:00:00:55")
        expected = {3: 200, 5: 20}
        assert wait_for(lambda: sniff_sender.totals() == expected), sniff_sender.totals()
        assert wait_for(lambda: sniff_bridge_port.totals() == expected), (
            sniff_bridge_port.totals()
        )
        assert sniff_peer.totals() == {}

        own_mac = mac_of(NS_A, A0)
        for sniffer, direction in ((sniff_sender, "tx"), (sniff_bridge_port, "rx")):
            samples = await sniffer.collect()
            counters = {(r.iface, r.counter): r.value for r in samples.nics}
            assert counters == {
                (sniffer.iface, "pfc_frames_prio3"): 200,
                (sniffer.iface, "pfc_frames_prio5"): 20,
            }
            events = {(e.attrs["src_mac"], e.attrs["priority"]): e.attrs for e in samples.events}
            assert set(events) == {(own_mac, 3), ("02:00:00:00:00:55", 5)}
            assert events[(own_mac, 3)]["frames"] == 200
            assert events[(own_mac, 3)]["quanta"] == 0xFFFF
            assert events[("02:00:00:00:00:55", 5)]["quanta"] == 0x10
            assert {a["direction"] for a in events.values()} == {direction}
            assert all(e.kind == "pfc_frames" for e in samples.events)

            # The next interval saw nothing new: no events, totals unchanged, rate 0.
            again = await sniffer.collect()
            assert again.events == []
            assert {r.counter: r.rate for r in again.nics} == {
                "pfc_frames_prio3": 0.0,
                "pfc_frames_prio5": 0.0,
            }
        assert len(await sniff_peer.collect()) == 0
    finally:
        for sniffer in sniffers:
            sniffer.stop()
        udp_a.close()
        udp_b.close()

