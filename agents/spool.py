"""The agent's on-disk queue of encoded batches.

Every batch is written here before it is sent, so a backend that is away
for minutes, or an agent that restarts, loses nothing. Layout of the folder::

    <dir>/00000000000000000042.json   one encoded batch per file, named by seq
    <dir>/state.json                  {"next_seq": 43}: the seq counter
    <dir>/rejected/                   batches the backend refused as malformed

Files are written atomically (temporary file, fsync, rename, fsync of the
folder), so a crash leaves either the whole batch or none of it. The queue
is bounded in bytes: when full, the oldest batches are dropped, counted in
``dropped`` and logged; that is the one loss allowed, and it is visible.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
_SUFFIX = ".json"
_TMP_SUFFIX = ".tmp"
_STATE_FILE = "state.json"
_REJECTED_DIR = "rejected"


def _fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _seq_of(name: str) -> int | None:
    if not name.endswith(_SUFFIX):
        return None
    stem = name[: -len(_SUFFIX)]
    return int(stem) if stem.isdigit() else None


class Spool:
    """Append-only, byte-bounded, restart-safe queue of encoded batches keyed by seq.

    Thread-safe: the shipper calls it from worker threads so that fsync never
    stalls the event loop.
    """

    def __init__(self, dir: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.dir = Path(dir)
        self.rejected_dir = self.dir / _REJECTED_DIR
        self.max_bytes = max_bytes
        self.dropped = 0  # batches dropped because the spool was full, since this object began
        self._lock = threading.Lock()
        self._sizes: dict[int, int] = {}  # seq -> bytes on disk, for the files in the queue
        self._bytes = 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rejected_dir.mkdir(exist_ok=True)
        self._state_path = self.dir / _STATE_FILE
        self._next_seq = self._recover()
        with self._lock:
            self._enforce_bound_locked()

    # -- recovery ---------------------------------------------------------------------------

    def _recover(self) -> int:
        """Index the files left by an earlier run and work out the next seq to hand out."""
        highest = -1
        for entry in os.scandir(self.dir):
            if entry.name.endswith(_TMP_SUFFIX):
                # A write that crashed before its rename: never acknowledged, never queued.
                os.unlink(entry.path)
                continue
            seq = _seq_of(entry.name)
            if seq is None or not entry.is_file():
                continue
            size = entry.stat().st_size
            self._sizes[seq] = size
            self._bytes += size
            highest = max(highest, seq)
        for entry in os.scandir(self.rejected_dir):
            seq = _seq_of(entry.name)
            if seq is not None:
                highest = max(highest, seq)
        persisted = 0
        try:
            persisted = int(json.loads(self._state_path.read_bytes())["next_seq"])
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("spool state %s unreadable (%s); continuing after seq on disk",
                        self._state_path, exc)
        return max(persisted, highest + 1)

    # -- seq counter ------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The seq the next ``allocate_seq`` call will hand out."""
        return self._next_seq

    def allocate_seq(self) -> int:
        """Hand out a fresh seq, persisted before it is returned.

        Persisting first means a restart can never hand the same seq out twice,
        which the backend would otherwise take as a duplicate and discard.
        """
        with self._lock:
            seq = self._next_seq
            self._persist_next_seq_locked(seq + 1)
            self._next_seq = seq + 1
            return seq

    def _persist_next_seq_locked(self, next_seq: int) -> None:
        write_atomically(self._state_path, json.dumps({"next_seq": next_seq}).encode())

    # -- queue ------------------------------------------------------------------------------

    def path_of(self, seq: int) -> Path:
        return self.dir / f"{seq:020d}{_SUFFIX}"

    def append(self, seq: int, data: bytes) -> None:
        """Store one encoded batch durably; drop the oldest ones if the bound is passed."""
        if seq < 0:
            raise ValueError("seq must be non-negative")
        with self._lock:
            if seq >= self._next_seq:
                # A seq not handed out by allocate_seq: keep the counter ahead of it.
                self._persist_next_seq_locked(seq + 1)
                self._next_seq = seq + 1
            write_atomically(self.path_of(seq), data)
            self._bytes += len(data) - self._sizes.get(seq, 0)
            self._sizes[seq] = len(data)
            self._enforce_bound_locked()

    def _enforce_bound_locked(self) -> None:
        # The newest batch always stays, even if it alone is over the bound.
        while self._bytes > self.max_bytes and len(self._sizes) > 1:
            oldest = min(self._sizes)
            self._remove_locked(oldest)
            self.dropped += 1
            log.warning(
                "spool %s full (%d > %d bytes): dropped oldest batch seq=%d (%d dropped so far)",
                self.dir, self._bytes, self.max_bytes, oldest, self.dropped,
            )

    def pending(self) -> list[int]:
        """The seqs waiting to be sent, oldest first."""
        with self._lock:
            return sorted(self._sizes)

    def oldest(self, limit: int) -> list[int]:
        """The ``limit`` oldest seqs waiting to be sent."""
        with self._lock:
            return sorted(self._sizes)[:limit]

    def read(self, seq: int) -> bytes | None:
        """The encoded batch ``seq``, or None if it is no longer queued (sent or dropped)."""
        try:
            return self.path_of(seq).read_bytes()
        except FileNotFoundError:
            return None

    def remove(self, seq: int) -> None:
        """Forget a batch the backend acknowledged. Removing one already gone is fine."""
        with self._lock:
            self._remove_locked(seq)

    def _remove_locked(self, seq: int) -> None:
        size = self._sizes.pop(seq, None)
        if size is None:
            return
        self._bytes -= size
        try:
            os.unlink(self.path_of(seq))
        except FileNotFoundError:
            pass

    def reject(self, seq: int, reason: str) -> Path | None:
        """Move a batch the backend refused as malformed to ``rejected/``, with the reason.

        Returns its new path, or None if it was no longer queued.
        """
        with self._lock:
            source = self.path_of(seq)
            target = self.rejected_dir / source.name
            try:
                os.replace(source, target)
            except FileNotFoundError:
                return None
            size = self._sizes.pop(seq, 0)
            self._bytes -= size
            write_atomically(self.rejected_dir / f"{seq:020d}.reason.txt", reason.encode())
            _fsync_dir(self.dir)
            return target

    def rejected(self) -> list[int]:
        """Seqs of the batches in ``rejected/``, oldest first."""
        seqs = (_seq_of(entry.name) for entry in os.scandir(self.rejected_dir))
        return sorted(seq for seq in seqs if seq is not None)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._sizes)
