"""Follow the kernel log and report NVIDIA Xid lines as events.

The source is /dev/kmsg (under ``Roots.dev``), read without blocking from its
end at start, one record per read (``pri,seq,ts_us,flags;message``). Where it
cannot be opened (no permission, a container without it) the collector
follows ``journalctl -k -f`` instead, and where neither works it says so once
in the log and reports nothing, like any collector whose hardware is absent.

The path can be any readable file or FIFO, so tests feed the real collector
through a file they append to.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from agents.collectors.base import Collector, Roots, Samples
from agents.parsers.xid import event_severity, parse_xid_line
from agents.protocol import Event

log = logging.getLogger(__name__)

# `-n 0`: start at the end, as with /dev/kmsg; kernel lines only.
DEFAULT_JOURNAL_CMD = ("journalctl", "-k", "-f", "-n", "0", "-o", "short-monotonic")

# A /dev/kmsg read must be able to hold a whole record or it fails with EINVAL.
_READ_SIZE = 16_384
# Bound the work of one collect() so a log storm cannot stall the agent loop.
_MAX_READS_PER_COLLECT = 10_000
_MAX_PARTIAL_BYTES = 1 << 20
_KMSG_RECORD = re.compile(r"^(?P<pri>\d+),(?P<seq>\d+),(?P<ts_us>\d+),[^;]*;(?P<message>.*)$")
_MAX_MESSAGE = 4096


class XidCollector(Collector):
    """Xid events from /dev/kmsg, or from journalctl where /dev/kmsg is closed to us."""

    name: ClassVar[str] = "xid"

    def __init__(
        self,
        roots: Roots | None = None,
        kmsg_path: Path | str | None = None,
        journal_cmd: Sequence[str] | None = DEFAULT_JOURNAL_CMD,
        from_start: bool = False,
        interval: float = 1.0,
    ) -> None:
        self.roots = roots or Roots()
        self.kmsg_path = Path(kmsg_path) if kmsg_path is not None else self.roots.dev / "kmsg"
        self.journal_cmd = tuple(journal_cmd) if journal_cmd else None
        self.from_start = from_start
        self.interval = interval
        self.source: str | None = None  # "kmsg", "journal" or "none" once opened
        self._fd: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._partial = b""
        self.records_lost = 0  # kmsg records overwritten before we read them

    # -- opening -----------------------------------------------------------

    def _open(self) -> None:
        try:
            fd = os.open(self.kmsg_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            log.info("xid: cannot open %s (%s); trying journalctl", self.kmsg_path, exc)
        else:
            if not self.from_start:
                try:
                    os.lseek(fd, 0, os.SEEK_END)
                except OSError:
                    pass  # a FIFO cannot seek; it has no past to skip anyway
            self._fd = fd
            self.source = "kmsg"
            return
        if self.journal_cmd:
            try:
                self._proc = subprocess.Popen(
                    self.journal_cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
            except OSError as exc:
                log.info("xid: cannot run %s (%s)", self.journal_cmd[0], exc)
            else:
                assert self._proc.stdout is not None
                os.set_blocking(self._proc.stdout.fileno(), False)
                self.source = "journal"
                return
        log.warning("xid: no kernel log source (%s, journalctl); reporting no Xids", self.kmsg_path)
        self.source = "none"

    # -- reading -----------------------------------------------------------

    def _read_chunks(self) -> list[bytes]:
        chunks: list[bytes] = []
        if self.source == "kmsg" and self._fd is not None:
            for _ in range(_MAX_READS_PER_COLLECT):
                try:
                    data = os.read(self._fd, _READ_SIZE)
                except BlockingIOError:
                    break
                except InterruptedError:
                    continue
                except OSError as exc:
                    if exc.errno == errno.EPIPE:
                        # The ring buffer wrapped past us; the next read goes on.
                        self.records_lost += 1
                        continue
                    log.warning("xid: reading %s failed: %s", self.kmsg_path, exc)
                    break
                if not data:
                    break  # end of a regular file, or a FIFO with no writer
                chunks.append(data)
        elif self.source == "journal" and self._proc is not None:
            stdout = self._proc.stdout
            assert stdout is not None
            for _ in range(_MAX_READS_PER_COLLECT):
                try:
                    data = os.read(stdout.fileno(), _READ_SIZE)
                except BlockingIOError:
                    break
                except OSError as exc:
                    log.warning("xid: reading journalctl failed: %s", exc)
                    break
                if not data:
                    if self._proc.poll() is not None:
                        log.warning("xid: journalctl exited (%s)", self._proc.returncode)
                        self._close_journal()
                        self.source = "none"
                    break
                chunks.append(data)
        return chunks

    def _lines(self, chunks: list[bytes]) -> list[str]:
        data = self._partial + b"".join(chunks)
        *complete, self._partial = data.split(b"\n")
        if len(self._partial) > _MAX_PARTIAL_BYTES:
            complete.append(self._partial)
            self._partial = b""
        # kmsg continuation lines (" SUBSYSTEM=pci") start with a space.
        return [
            raw.decode("utf-8", errors="replace")
            for raw in complete
            if raw and not raw.startswith(b" ")
        ]

    async def collect(self) -> Samples:
        if self.source is None:
            self._open()
        samples = Samples()
        if self.source == "none":
            return samples
        for line in self._lines(self._read_chunks()):
            event = self._event(line)
            if event is not None:
                samples.events.append(event)
        return samples

    def _event(self, line: str) -> Event | None:
        kmsg_seq: int | None = None
        record = _KMSG_RECORD.match(line)
        if record:
            kmsg_seq = int(record["seq"])
            line = record["message"]
        parsed = parse_xid_line(line)
        if parsed is None:
            return None
        attrs: dict[str, Any] = {
            "pci": parsed["pci"],
            "xid": parsed["xid"],
            "pid": parsed["pid"],
            "process": parsed["process"],
            "action": parsed["action"],
        }
        for optional in ("mnemonic", "recovery_action", "fatal"):
            if parsed.get(optional) is not None:
                attrs[optional] = parsed[optional]
        if kmsg_seq is not None:
            attrs["kmsg_seq"] = kmsg_seq
        # Records are read within a second of being written (we start at the
        # end), so the read time is the event time; kmsg's ts_us counts from
        # boot and would need a boot-time estimate to be any better.
        return Event(
            ts=datetime.now(UTC),
            kind="xid",
            severity=event_severity(parsed["severity"]),  # type: ignore[arg-type]
            message=line[:_MAX_MESSAGE],
            attrs=attrs,
        )

    # -- closing -----------------------------------------------------------

    def _close_journal(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    async def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._close_journal()
        self.source = None
        self._partial = b""
