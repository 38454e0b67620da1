"""The on-disk spool: order, restart safety, the byte bound and the rejected folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agents.spool import Spool


def _payload(seq: int, size: int = 100) -> bytes:
    body = json.dumps({"seq": seq}).encode()
    return body + b" " * (size - len(body))


def _fill(spool: Spool, count: int, size: int = 100) -> list[int]:
    seqs = []
    for _ in range(count):
        seq = spool.allocate_seq()
        spool.append(seq, _payload(seq, size))
        seqs.append(seq)
    return seqs


def test_batches_replay_in_seq_order_after_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    seqs = _fill(spool, 12)  # past 10, so file names must sort numerically, not as text
    assert seqs == list(range(12))

    reopened = Spool(tmp_path, max_bytes=1 << 20)
    assert reopened.pending() == seqs
    assert [json.loads(reopened.read(seq) or b"")["seq"] for seq in reopened.pending()] == seqs
    assert reopened.allocate_seq() == 12


def test_seq_is_never_reused_after_everything_was_delivered(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    for seq in _fill(spool, 5):
        spool.remove(seq)  # acknowledged by the backend, gone from disk
    assert len(spool) == 0

    reopened = Spool(tmp_path)
    # The server already holds seqs 0..4: handing one out again would be taken as a duplicate.
    assert reopened.allocate_seq() == 5


def test_seq_continues_after_highest_file_when_state_file_is_lost(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    _fill(spool, 3)
    (tmp_path / "state.json").unlink()

    assert Spool(tmp_path).allocate_seq() == 3


def test_allocated_seq_is_persisted_before_it_is_used(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    assert spool.allocate_seq() == 0
    assert spool.allocate_seq() == 1
    # The agent died before spooling batch 1: it may have been sent, so 1 is burnt.
    assert Spool(tmp_path).allocate_seq() == 2


def test_full_spool_drops_oldest_and_counts(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                            ) -> None:
    spool = Spool(tmp_path, max_bytes=350)
    with caplog.at_level(logging.WARNING, logger="agents.spool"):
        _fill(spool, 6, size=100)

    assert spool.pending() == [3, 4, 5]
    assert spool.dropped == 3
    assert spool.bytes_used == 300
    assert sorted(p.name for p in tmp_path.glob("*.json") if p.name != "state.json") == [
        f"{seq:020d}.json" for seq in (3, 4, 5)
    ]
    assert sum("dropped oldest batch" in r.getMessage() for r in caplog.records) == 3


def test_newest_batch_is_kept_even_when_alone_over_the_bound(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=50)
    _fill(spool, 2, size=100)
    assert spool.pending() == [1]
    assert spool.dropped == 1


def test_reopening_with_a_smaller_bound_drops_oldest(tmp_path: Path) -> None:
    _fill(Spool(tmp_path, max_bytes=1 << 20), 5, size=100)
    reopened = Spool(tmp_path, max_bytes=250)
    assert reopened.pending() == [3, 4]
    assert reopened.dropped == 3


def test_interrupted_write_leaves_nothing_queued(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    _fill(spool, 2)
    # What a crash between write and rename leaves behind.
    (tmp_path / f"{2:020d}.json.tmp").write_bytes(b'{"seq": 2, "trunc')

    reopened = Spool(tmp_path)
    assert reopened.pending() == [0, 1]
    assert not list(tmp_path.glob("*.tmp"))


def test_reject_moves_batch_with_reason_and_keeps_its_seq_burnt(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    _fill(spool, 3)
    moved = spool.reject(2, "HTTP 422\nhosts.0.cpu_pct: less than or equal to 100\n")

    assert moved == tmp_path / "rejected" / f"{2:020d}.json"
    assert json.loads(moved.read_bytes())["seq"] == 2
    reason = (tmp_path / "rejected" / f"{2:020d}.reason.txt").read_text()
    assert "422" in reason
    assert spool.pending() == [0, 1]
    assert spool.rejected() == [2]
    assert spool.bytes_used == 200

    (tmp_path / "state.json").unlink()
    assert Spool(tmp_path).allocate_seq() == 3
