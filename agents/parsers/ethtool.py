"""Parse ``ethtool -S`` output and pull out the pause (802.3x) and PFC (802.1Qbb) figures.

Drivers name the same figure differently; this module maps them onto one
vocabulary, the mlx5 names, which the rest of meshwatch speaks:

============================  ===================================================
canonical name                driver names
============================  ===================================================
``{rx,tx}_prio{p}_pause``     mlx5 ``rx_prio3_pause``; bnxt_en
                              ``rx_pfc_ena_frames_pri3``; ice/i40e
                              ``rx_priority_3_xoff.nic`` / ``port.rx_priority_3_xoff``;
                              ixgbe ``rx_pb_3_pxoff``
``{rx,tx}_prio{p}_pause_duration``  mlx5 ``rx_prio3_pause_duration`` (microseconds);
                              bnxt_en ``pfc_pri3_rx_duration_us``
``{rx,tx}_pause``             link-level pause: mlx5 ``rx_pause_ctrl_phy`` /
                              ``rx_global_pause``; bnxt_en ``rx_pause_frames``;
                              ice ``link_xoff_rx.nic``; generic ``rx_pause``
``{rx,tx}_pause_duration``    mlx5 ``rx_global_pause_duration``
============================  ===================================================

Durations are microseconds of pause; pause counts are frames. XON frames
("resume") are not pauses and are not counted as such.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

PRIORITIES = range(8)

# Per-priority figures: (regex, direction group, priority group, figure).
_PRIO_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^(?P<dir>rx|tx)_prio(?P<p>[0-7])_pause$"), "pause"),
    (re.compile(r"^(?P<dir>rx|tx)_prio(?P<p>[0-7])_pause_duration$"), "pause_duration"),
    (re.compile(r"^(?P<dir>rx|tx)_pfc_ena_frames_pri(?P<p>[0-7])$"), "pause"),
    (re.compile(r"^pfc_pri(?P<p>[0-7])_(?P<dir>rx|tx)_duration_us$"), "pause_duration"),
    (re.compile(r"^(?:port\.)?(?P<dir>rx|tx)_priority_(?P<p>[0-7])_xoff(?:\.nic)?$"), "pause"),
    (re.compile(r"^(?P<dir>rx|tx)_pb_(?P<p>[0-7])_pxoff$"), "pause"),
]

# Link-level (802.3x) figures in order of preference: the first present wins, so
# a driver that reports the same frames under two names is not counted twice.
_LINK_NAMES: dict[str, tuple[str, ...]] = {
    "rx_pause": (
        "rx_pause_ctrl_phy", "rx_global_pause", "rx_pause", "rx_pause_frames",
        "link_xoff_rx.nic", "port.link_xoff_rx", "link_xoff_rx", "rx_flow_control_xoff",
    ),
    "tx_pause": (
        "tx_pause_ctrl_phy", "tx_global_pause", "tx_pause", "tx_pause_frames", "tx_pauseframes",
        "link_xoff_tx.nic", "port.link_xoff_tx", "link_xoff_tx", "tx_flow_control_xoff",
    ),
    "rx_pause_duration": ("rx_global_pause_duration", "rx_pause_duration"),
    "tx_pause_duration": ("tx_global_pause_duration", "tx_pause_duration"),
}
# Extra link-level figures passed through under their own names.
_LINK_EXTRAS = (
    "rx_pfc_frames", "tx_pfc_frames",
    "tx_pause_storm_warning_events", "tx_pause_storm_error_events",
)
_FIGURES = ("rx_pause", "tx_pause", "rx_pause_duration", "tx_pause_duration")

# Counters worth shipping: pause/PFC/priority figures, discards, drops and errors.
_KEEP = re.compile(
    r"pause|pfc|prio|_pri\d|priority|xoff|xon|discard|drop|err|storm|out_of_buffer|"
    r"crc|symbol|fec_uncorr|link_down"
)
# Per-queue, per-ring and per-channel counters: hundreds of them, none needed here.
_PER_QUEUE = re.compile(
    r"^(\[\d+\]|(rx|tx|ch|xdp|ptp|qos)\d+_|(rx|tx)_queue_\d+_|(rx|tx)q\d+[:_]|txq_?\d+|rxq_?\d+|"
    r"queue_\d+_|ring_?\d+|tx\d+_\d+_)"
)
# Per-priority traffic volumes (rx_prio3_bytes) are load, not faults.
_VOLUME = re.compile(r"bytes|packets|frames_pri|_pkts")
_FAULT = re.compile(r"pause|pfc_ena|discard|drop|err|xoff|storm")


def parse_ethtool_stats(text: str) -> dict[str, int]:
    """Counters of one ``ethtool -S IFACE`` output, name -> value.

    Lines that are not ``name: integer`` (the "NIC statistics:" header, a shell
    prompt, a counter with a non-numeric value) are skipped. bnxt_en's per-ring
    lines (``[0]: rx_discards: 7``) keep their ring prefix in the name.
    """
    stats: dict[str, int] = {}
    for line in text.splitlines():
        parsed = _parse_counter_line(line)
        if parsed is not None:
            stats[parsed[0]] = parsed[1]
    return stats


def _parse_counter_line(line: str) -> tuple[str, int] | None:
    name, sep, value = line.strip().rpartition(":")
    if not sep or not name:
        return None
    value = value.strip().replace(",", "")
    if not value.isdigit():
        return None
    # "[0]: rx_bytes" -> "[0]:rx_bytes": one token, still unambiguous.
    return re.sub(r":\s+", ":", name.strip()), int(value)


def classify_counter(name: str) -> tuple[int | None, str] | None:
    """Map a driver counter name onto (priority or None for link level, canonical figure).

    The figure is one of rx_pause, tx_pause, rx_pause_duration, tx_pause_duration.
    None when the name is not a pause figure.
    """
    for pattern, figure in _PRIO_PATTERNS:
        m = pattern.match(name)
        if m:
            return int(m["p"]), f"{m['dir']}_{figure}"
    for figure, names in _LINK_NAMES.items():
        if name in names:
            return None, figure
    return None


def canonical_name(priority: int | None, figure: str) -> str:
    """``(3, "tx_pause")`` -> ``tx_prio3_pause``; ``(None, "tx_pause")`` -> ``tx_pause``."""
    if priority is None:
        return figure
    direction, rest = figure.split("_", 1)
    return f"{direction}_prio{priority}_{rest}"


def pfc_figures(stats: dict[str, int]) -> list[dict[str, Any]]:
    """Per-priority pause figures found in one interface's counters.

    One dict per priority that the driver reports anything for, in priority
    order, then one for the link-level (802.3x) pause with ``priority`` None if
    the driver reports any. Keys: priority, rx_pause, tx_pause,
    rx_pause_duration, tx_pause_duration (None where the driver has no such
    counter); the link-level entry also carries rx_pfc_frames, tx_pfc_frames
    and the mlx5 tx_pause_storm_*_events where present.
    """
    per_prio: dict[int, dict[str, Any]] = {}
    for name, value in stats.items():
        for pattern, figure in _PRIO_PATTERNS:
            m = pattern.match(name)
            if m:
                entry = per_prio.setdefault(int(m["p"]), _empty(int(m["p"])))
                key = f"{m['dir']}_{figure}"
                # Two drivers' names never meet in one output; if they did, keep the first.
                if entry[key] is None:
                    entry[key] = value
                break
    figures = [per_prio[p] for p in sorted(per_prio)]

    link = _empty(None)
    found = False
    for figure, names in _LINK_NAMES.items():
        for name in names:
            if name in stats:
                link[figure] = stats[name]
                found = True
                break
    for name in _LINK_EXTRAS:
        if name in stats:
            link[name] = stats[name]
            found = True
    if found:
        figures.append(link)
    return figures


def _empty(priority: int | None) -> dict[str, Any]:
    return {"priority": priority, **dict.fromkeys(_FIGURES)}


def keep_counter(name: str) -> bool:
    """True for the counters the agent ships: pause/PFC/priority, discard, drop, error.

    Per-queue and per-ring counters are left out: a 128-queue NIC has hundreds
    and the port-level totals carry the same news.
    """
    if not _KEEP.search(name) or _PER_QUEUE.match(name):
        return False
    return not _VOLUME.search(name) or bool(_FAULT.search(name))


_IFACE_IN_COMMAND = re.compile(r"ethtool\s+(?:-S|--statistics)\s+([A-Za-z0-9_.:@+-]+)")
_STATISTICS_HEADER = re.compile(r"^\s*NIC statistics\s*:?\s*$")


def parse_lines(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """One JSON-able dict per interface counter group found in the lines.

    A group begins at a "NIC statistics:" header or at an ``ethtool -S IFACE``
    command line (whose IFACE names it); counter lines before any header form a
    group of their own (a ``grep`` of the output). Each dict:
    ``{"kind": "ethtool", "iface": str | None, "counters": {kept counters},
    "pfc": pfc_figures(...)}``. Groups with no counter are not yielded.
    """
    iface: str | None = None
    stats: dict[str, int] = {}

    def flush() -> Iterator[dict[str, Any]]:
        if stats:
            yield {
                "kind": "ethtool",
                "iface": iface,
                "counters": {k: v for k, v in stats.items() if keep_counter(k)},
                "pfc": pfc_figures(stats),
            }

    for raw in lines:
        line = raw.rstrip("\n")
        command = _IFACE_IN_COMMAND.search(line)
        if command:
            yield from flush()
            iface, stats = command.group(1), {}
            continue
        if _STATISTICS_HEADER.match(line):
            if stats:  # a second header with no command between: a new, unnamed group
                yield from flush()
                iface, stats = None, {}
            continue
        parsed = _parse_counter_line(line)
        if parsed is not None:
            stats[parsed[0]] = parsed[1]
    yield from flush()
