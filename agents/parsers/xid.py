"""Parse NVIDIA driver Xid lines from the kernel log.

The driver writes ``NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python,
GPU has fallen off the bus.``; older drivers omit ``PCI:`` and the pid/name
pair. Whatever is in front of ``NVRM:`` (a /dev/kmsg record header, a dmesg
timestamp, a journal or syslog prefix) is ignored.

What an Xid means and what to do about it come from ``xid_catalog.json``, a
copy of NVIDIA's Xid catalogue (its URL is the file's ``source``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

CATALOG_PATH = Path(__file__).with_name("xid_catalog.json")

SEVERITIES = ("info", "warning", "error", "critical")
# Severity of an Xid the catalogue does not list: unknown is worth a look.
UNKNOWN_XID_SEVERITY = "warning"

_XID_LINE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\):"
    r"\s*(?P<xid>\d{1,5})\b,?\s*(?P<rest>.*)$"
)
_PID = re.compile(r"^pid=(?P<pid>'?<unknown>'?|\d+)(?:,\s*|$)")
_NAME = re.compile(r"^name=(?P<name>.*?)(?:,\s+|$)")
_RECOVERY = re.compile(
    r"GPU recovery action changed from 0x[0-9A-Fa-f]+ \((?P<old>[^)]*)\) "
    r"to 0x[0-9A-Fa-f]+ \((?P<new>[^)]*)\)"
)
# NVLink5 Xids (144-150) say per line whether the error was fatal.
_FATALITY = re.compile(r"\b(?P<fatality>Nonfatal|Fatal)\b")
_NVLINK5_XIDS = frozenset(range(144, 151))

MAX_LINE_CHARS = 16_384


class CatalogError(ValueError):
    """The Xid catalogue file is malformed."""


@lru_cache(maxsize=1)
def load_catalog(path: Path = CATALOG_PATH) -> dict[str, Any]:
    """The Xid catalogue, validated once per process."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CatalogError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(doc.get("source"), str) or not doc["source"].startswith("https://"):
        raise CatalogError(f"{path}: needs a 'source' URL")
    xids = doc.get("xids")
    if not isinstance(xids, dict) or not xids:
        raise CatalogError(f"{path}: needs a non-empty 'xids' object")
    for key, entry in xids.items():
        if not key.isdigit():
            raise CatalogError(f"{path}: Xid key {key!r} is not a number")
        for field in ("mnemonic", "description", "action", "severity"):
            if not isinstance(entry.get(field), str):
                raise CatalogError(f"{path}: Xid {key} lacks {field!r}")
        if entry["severity"] not in SEVERITIES:
            raise CatalogError(f"{path}: Xid {key} has severity {entry['severity']!r}")
    for name, entry in doc.get("recovery_actions_154", {}).items():
        if entry.get("severity") not in SEVERITIES or not isinstance(entry.get("action"), str):
            raise CatalogError(f"{path}: recovery action {name!r} is malformed")
    return doc


def catalog_entry(xid: int) -> dict[str, Any] | None:
    """The catalogue's entry for one Xid, or None when it does not list it."""
    entry = load_catalog()["xids"].get(str(xid))
    return dict(entry) if entry is not None else None


def event_severity(value: str | None) -> str:
    """Map a catalogue (or foreign) severity word onto info/warning/error/critical."""
    if value is None:
        return UNKNOWN_XID_SEVERITY
    word = value.strip().lower()
    if word in SEVERITIES:
        return word
    aliases = {"fatal": "critical", "high": "critical", "warn": "warning", "low": "info"}
    return aliases.get(word, UNKNOWN_XID_SEVERITY)


def _pid_and_process(rest: str) -> tuple[int | None, str | None, str]:
    pid: int | None = None
    process: str | None = None
    m = _PID.match(rest)
    if m:
        pid = int(m["pid"]) if m["pid"].isdigit() else None
        rest = rest[m.end() :]
        n = _NAME.match(rest)
        if n:
            name = n["name"].strip()
            process = None if name in ("<unknown>", "'<unknown>'", "") else name
            rest = rest[n.end() :]
    return pid, process, rest.strip()


def parse_xid_line(line: str | bytes) -> dict[str, Any] | None:
    """Return the Xid event a kernel log line reports, or None."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.rstrip("\r\n")
    m = _XID_LINE.search(line[:MAX_LINE_CHARS])
    if not m:
        return None
    xid = int(m["xid"])
    pid, process, message = _pid_and_process(m["rest"])
    entry = catalog_entry(xid)
    event: dict[str, Any] = {
        "kind": "xid",
        "pci": m["pci"].lower(),
        "xid": xid,
        "pid": pid,
        "process": process,
        "message": message,
        "action": entry["action"] if entry else None,
        "severity": entry["severity"] if entry else UNKNOWN_XID_SEVERITY,
        "description": entry["description"] if entry else None,
        "mnemonic": entry["mnemonic"] if entry else None,
        "investigatory_action": entry.get("investigatory_action") if entry else None,
    }
    if xid == 154:
        # Xid 154 names the recovery the accompanying Xids need; that, not the
        # catalogue's "XID_154" placeholder, is what to act on.
        r = _RECOVERY.search(message)
        if r:
            recovery = r["new"].strip()
            event["recovery_action"] = recovery
            known = load_catalog().get("recovery_actions_154", {}).get(recovery)
            if known:
                event["action"] = known["action"]
                event["severity"] = known["severity"]
    if xid in _NVLINK5_XIDS:
        f = _FATALITY.search(message)
        if f:
            event["fatal"] = f["fatality"] == "Fatal"
            event["severity"] = "critical" if event["fatal"] else "warning"
    event["line"] = line
    return event


def parse_lines(lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    """Xid events from kernel log lines (str or bytes; embedded newlines are split)."""
    for item in lines:
        if isinstance(item, bytes):
            item = item.decode("utf-8", errors="replace")
        for line in item.splitlines() or [item]:
            event = parse_xid_line(line)
            if event is not None:
                yield event
