"""Follow training job logs and report NCCL / PyTorch failures as events.

Behaves like ``tail -F`` over a set of paths and glob patterns:

* files that exist at start are read from their end (``from_start=True``
  replays them, for tests and post-mortems); files that appear later are read
  from their beginning;
* a file is followed by inode, so after a rotation (rename + new file) the old
  file is drained to its end before the new one is read, and a rotated file
  that still matches a pattern is not read twice;
* a file that shrinks was truncated (copytruncate) and is read again from 0;
* a line is only parsed once its newline has arrived; bytes that are not
  UTF-8 are replaced, never fatal.

Which lines matter is decided by ``agents.parsers.nccl`` and its rule files.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, BinaryIO, ClassVar

from agents.collectors.base import Collector, Samples
from agents.parsers.nccl import NcclLogParser
from agents.protocol import Event

log = logging.getLogger(__name__)

# One collect() reads at most this much per file; the rest waits for the next.
MAX_BYTES_PER_FILE = 8 << 20
# A "line" longer than this without a newline is parsed as it is.
MAX_PARTIAL_BYTES = 1 << 20
_MAX_MESSAGE = 4096
_MAX_RANK = 10_000_000
_IDENT = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,128}$")
# Fields of a parsed event that become attrs; everything else stays out.
_SKIP_ATTRS = frozenset({"kind", "severity", "rank", "message"})

FileKey = tuple[int, int]  # (st_dev, st_ino)


@dataclass
class _FollowedFile:
    path: str
    handle: BinaryIO
    position: int
    parser: NcclLogParser = field(default_factory=NcclLogParser)
    partial: bytes = b""


class NcclLogCollector(Collector):
    """NCCL timeouts and errors from the log files of a training job."""

    name: ClassVar[str] = "nccl"

    def __init__(
        self,
        patterns: list[str] | None = None,
        job: str | None = None,
        rank_offset: int | None = None,
        default_rank: int | None = None,
        from_start: bool = False,
        interval: float = 1.0,
        nccl_log_globs: list[str] | None = None,
    ) -> None:
        """Follow ``patterns`` (paths or globs).

        ``nccl_log_globs`` is the agent configuration's name for more patterns,
        so the daemon can build the collector from its config by keyword.

        The rank of an event is the one its line names (``[Rank 3]``,
        ``[rank3]:``). Failing that, a line that names a local rank
        (``[default3]:``, torchrun's ``local_rank: 3``) gets
        ``rank_offset + local rank`` when ``rank_offset`` is set (the node's
        first global rank), and any other line gets ``default_rank``.
        """
        patterns = [*(patterns or []), *(nccl_log_globs or [])]
        if not patterns:
            raise ValueError("NcclLogCollector needs at least one path or glob")
        if job is not None and not _IDENT.match(job):
            raise ValueError(f"job {job!r} is not a valid identifier")
        self.patterns = [os.path.expanduser(p) for p in patterns]
        self.job = job
        self.rank_offset = rank_offset
        self.default_rank = default_rank
        self.from_start = from_start
        self.interval = interval
        self._files: dict[FileKey, _FollowedFile] = {}
        self._started = False

    # -- following ---------------------------------------------------------

    def _matching_paths(self) -> dict[FileKey, str]:
        found: dict[FileKey, str] = {}
        for pattern in self.patterns:
            paths = glob.glob(pattern) if glob.has_magic(pattern) else [pattern]
            for path in sorted(paths):
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if not os.path.isfile(path):
                    continue
                found.setdefault((st.st_dev, st.st_ino), path)
        return found

    def _open(self, key: FileKey, path: str, at_end: bool) -> None:
        try:
            handle = open(path, "rb")  # noqa: SIM115 - kept open to follow the inode
        except OSError as exc:
            log.info("nccl_log: cannot open %s: %s", path, exc)
            return
        st = os.fstat(handle.fileno())
        if (st.st_dev, st.st_ino) != key:
            # Replaced between stat and open; the next poll sees the new one.
            handle.close()
            return
        position = st.st_size if at_end else 0
        handle.seek(position)
        self._files[key] = _FollowedFile(path=path, handle=handle, position=position)

    def _read_new(self, followed: _FollowedFile) -> list[bytes]:
        """Whole lines appended since the last read (the last partial line is kept)."""
        try:
            size = os.fstat(followed.handle.fileno()).st_size
        except OSError:
            return []
        if size < followed.position:
            log.info("nccl_log: %s was truncated; reading it again from the start", followed.path)
            followed.position = 0
            followed.partial = b""
            followed.handle.seek(0)
        data = followed.handle.read(MAX_BYTES_PER_FILE) if size > followed.position else b""
        followed.position += len(data)
        if not data:
            return []
        buffered = followed.partial + data
        *lines, followed.partial = buffered.split(b"\n")
        if len(followed.partial) > MAX_PARTIAL_BYTES:
            lines.append(followed.partial)
            followed.partial = b""
        return lines

    def _poll_lines(self) -> list[tuple[_FollowedFile, bytes]]:
        out: list[tuple[_FollowedFile, bytes]] = []
        # Drain every followed inode first: a rotated file's last lines come
        # before the first lines of the file that replaced it.
        for followed in list(self._files.values()):
            out.extend((followed, line) for line in self._read_new(followed))

        current = self._matching_paths()
        for key in list(self._files):
            if key in current:
                self._files[key].path = current[key]
            else:
                # Rotated out of the patterns or deleted, and drained above.
                self._files.pop(key).handle.close()
        for key, path in current.items():
            if key not in self._files:
                self._open(key, path, at_end=not self._started and not self.from_start)
                if key in self._files:
                    followed = self._files[key]
                    out.extend((followed, line) for line in self._read_new(followed))
        self._started = True
        return out

    # -- events ------------------------------------------------------------

    def _rank(self, parsed: dict[str, Any]) -> int | None:
        rank = parsed.get("rank")
        if rank is None and self.rank_offset is not None and parsed.get("local_rank") is not None:
            rank = self.rank_offset + parsed["local_rank"]
        if rank is None:
            rank = self.default_rank
        if rank is None or not 0 <= rank <= _MAX_RANK:
            return None
        return rank

    def _event(self, followed: _FollowedFile, raw: bytes) -> Event | None:
        parsed = followed.parser.parse_line(raw)
        if parsed is None:
            return None
        attrs: dict[str, Any] = {
            key: value
            for key, value in parsed.items()
            if key not in _SKIP_ATTRS and value is not None and _IDENT.match(key)
        }
        attrs["file"] = followed.path
        return Event(
            ts=datetime.now(UTC),
            kind=parsed["kind"],
            severity=parsed["severity"],
            job=self.job,
            rank=self._rank(parsed),
            message=parsed["message"][:_MAX_MESSAGE],
            attrs=attrs,
        )

    async def collect(self) -> Samples:
        samples = Samples()
        for followed, raw in self._poll_lines():
            event = self._event(followed, raw)
            if event is not None:
                samples.events.append(event)
        return samples

    async def close(self) -> None:
        for followed in self._files.values():
            followed.handle.close()
        self._files.clear()
        self._started = False
