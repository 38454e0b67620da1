"""802.1Qbb priority flow control (PFC) frames: build, parse, send.

A PFC frame is a MAC control frame to 01:80:c2:00:00:01, EtherType 0x8808,
opcode 0x0101, then a 16-bit class-enable vector (bit p set: the pause time
for priority p is valid) and eight 16-bit pause times in quanta of 512 bit
times, padded to the 60-byte Ethernet minimum. Quanta 0 for an enabled
priority means "resume" (XON).

``emit_pfc`` sends them from a raw AF_PACKET socket; the lab uses it to play a
NIC that floods the fabric with pauses. Run as a module to emit from inside a
network namespace: ``python -m agents.pfc IFACE --priority 3 --rate 1000 --seconds 5``.
"""

from __future__ import annotations

import argparse
import socket
import struct
import time
from dataclasses import dataclass

PFC_DST_MAC = bytes.fromhex("0180c2000001")
MAC_CONTROL_ETHERTYPE = 0x8808
PFC_OPCODE = 0x0101
PAUSE_OPCODE = 0x0001  # 802.3x link-level pause, same EtherType
MIN_FRAME_LEN = 60  # without the FCS the NIC appends

_HEADER = struct.Struct("!6s6sHHH8H")  # dst, src, ethertype, opcode, class-enable, 8 x quanta


@dataclass(frozen=True)
class PfcFrame:
    """One parsed PFC frame."""

    dst_mac: str
    src_mac: str
    class_enable: int
    quanta: tuple[int, ...]  # eight pause times, index = priority

    @property
    def priorities(self) -> list[int]:
        """Priorities whose pause time this frame sets (class-enable bits)."""
        return [p for p in range(8) if self.class_enable & (1 << p)]


def mac_to_bytes(mac: str) -> bytes:
    """"02:00:00:00:00:01" -> 6 bytes."""
    raw = bytes.fromhex(mac.replace(":", "").replace("-", ""))
    if len(raw) != 6:
        raise ValueError(f"not a MAC address: {mac!r}")
    return raw


def mac_to_str(raw: bytes) -> str:
    return ":".join(f"{b:02x}" for b in raw)


def build_pfc_frame(src_mac: str | bytes, pause: dict[int, int]) -> bytes:
    """A PFC frame from ``src_mac`` pausing each priority in ``pause`` for its quanta.

    ``pause`` maps priority (0-7) to pause quanta (0-65535); priorities not in
    it are left disabled in the class-enable vector.
    """
    src = src_mac if isinstance(src_mac, bytes) else mac_to_bytes(src_mac)
    if len(src) != 6:
        raise ValueError("source MAC must be 6 bytes")
    quanta = [0] * 8
    enable = 0
    for priority, q in pause.items():
        if not 0 <= priority <= 7:
            raise ValueError(f"priority {priority} is outside 0-7")
        if not 0 <= q <= 0xFFFF:
            raise ValueError(f"pause quanta {q} is outside 0-65535")
        enable |= 1 << priority
        quanta[priority] = q
    frame = _HEADER.pack(
        PFC_DST_MAC, src, MAC_CONTROL_ETHERTYPE, PFC_OPCODE, enable, *quanta
    )
    return frame.ljust(MIN_FRAME_LEN, b"\x00")


def parse_pfc_frame(data: bytes) -> PfcFrame | None:
    """The PFC frame in ``data`` (an Ethernet frame from its destination MAC), or None."""
    if len(data) < _HEADER.size:
        return None
    dst, src, ethertype, opcode, enable, *quanta = _HEADER.unpack_from(data)
    if ethertype != MAC_CONTROL_ETHERTYPE or opcode != PFC_OPCODE:
        return None
    return PfcFrame(mac_to_str(dst), mac_to_str(src), enable & 0xFF, tuple(quanta))


def open_raw_socket(iface: str) -> socket.socket:
    """A raw AF_PACKET socket bound to ``iface`` for sending whole Ethernet frames."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # protocol 0: send only
    try:
        sock.bind((iface, 0))
    except OSError:
        sock.close()
        raise
    return sock


def interface_mac(sock: socket.socket) -> bytes:
    """The hardware address of the interface a bound AF_PACKET socket is on."""
    # getsockname() of an AF_PACKET socket: (ifname, proto, pkttype, hatype, addr)
    return sock.getsockname()[4]


def emit_pfc(
    iface: str,
    priority: int,
    rate_pps: float,
    seconds: float,
    quanta: int = 0xFFFF,
    src_mac: str | None = None,
) -> int:
    """Send PFC frames pausing ``priority`` on ``iface`` at ``rate_pps`` for ``seconds``.

    Frames go out at evenly spaced deadlines (no drift over long runs); the
    source MAC is the interface's own unless ``src_mac`` is given. Returns the
    number of frames sent.
    """
    if rate_pps <= 0 or seconds < 0:
        raise ValueError("rate_pps must be > 0 and seconds >= 0")
    total = int(round(rate_pps * seconds))
    sock = open_raw_socket(iface)
    try:
        src = mac_to_bytes(src_mac) if src_mac else interface_mac(sock)
        frame = build_pfc_frame(src, {priority: quanta})
        period = 1.0 / rate_pps
        start = time.monotonic()
        for i in range(total):
            # Pacing a sender is what sleep is for; tests wait on conditions instead.
            delay = start + i * period - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            sock.send(frame)
        return total
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agents.pfc", description="Send 802.1Qbb PFC pause frames."
    )
    parser.add_argument("iface")
    parser.add_argument("--priority", type=int, default=3)
    parser.add_argument("--rate", type=float, default=100.0, help="frames per second")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--quanta", type=lambda s: int(s, 0), default=0xFFFF)
    parser.add_argument("--src-mac", default=None)
    args = parser.parse_args(argv)
    sent = emit_pfc(args.iface, args.priority, args.rate, args.seconds, args.quanta, args.src_mac)
    print(sent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
