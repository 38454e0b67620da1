"""The Xid and NCCL log collectors, run against real files, FIFOs and processes.

Lines written are real log lines from tests/fixtures (see the SOURCES.md
files there). /dev/kmsg records are framed as the kernel frames them
(Documentation/ABI/testing/dev-kmsg): ``pri,seq,ts_us,flags;message``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest

from agents.collectors.base import Roots, Samples
from agents.collectors.nccl_log import NcclLogCollector
from agents.collectors.xid import XidCollector
from agents.protocol import Batch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
XID_LINES = {
    "bus": (FIXTURES / "xid" / "modal_gpu_health.log").read_text().splitlines()[0],
    "gsp": (FIXTURES / "xid" / "open_gpu_kernel_modules_446_talos.log").read_text().splitlines()[2],
    "mmu": (FIXTURES / "xid" / "chia_gigahorse_301_dmesg.log").read_text().splitlines()[1],
    "noise": (FIXTURES / "xid" / "chia_gigahorse_301_dmesg.log").read_text().splitlines()[5],
}


def nccl_lines(name: str) -> list[str]:
    return (FIXTURES / "nccl" / name).read_text().splitlines()


def kmsg(seq: int, message: str, pri: int = 4) -> bytes:
    """One /dev/kmsg record around the kernel message part of a real log line."""
    text = message[message.index("NVRM:") :] if "NVRM:" in message else message
    return f"{pri},{seq},{seq * 1000},-;{text}\n".encode()


def append(path: Path, data: bytes | str) -> None:
    with open(path, "ab") as f:
        f.write(data.encode() if isinstance(data, str) else data)


async def collect_until(collector, count: int, deadline_s: float = 10.0) -> Samples:
    """Collect until ``count`` events arrived or the deadline passed."""
    total = Samples()
    deadline = time.monotonic() + deadline_s
    while True:
        total.extend(await collector.collect())
        if len(total.events) >= count or time.monotonic() > deadline:
            return total
        await asyncio.sleep(0.02)


def fits_a_batch(samples: Samples) -> None:
    Batch(node="node-1", seq=1, sent_at=samples.events[0].ts, events=samples.events)


# ---------------------------------------------------------------- XidCollector


async def test_xid_collector_starts_at_the_end_of_the_kernel_log(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    kmsg_file = dev / "kmsg"
    kmsg_file.write_bytes(kmsg(1, XID_LINES["mmu"]))  # before the agent started: not reported
    collector = XidCollector(roots=Roots(dev=dev), journal_cmd=None)
    try:
        assert (await collector.collect()).events == []
        assert collector.source == "kmsg"
        append(
            kmsg_file,
            kmsg(2, XID_LINES["noise"], pri=6)
            + kmsg(3, XID_LINES["bus"], pri=3)
            + b" SUBSYSTEM=pci\n DEVICE=+pci:0000:c6:00.0\n"
            + kmsg(4, XID_LINES["gsp"]),
        )
        samples = await collector.collect()
    finally:
        await collector.close()
    bus, gsp = samples.events
    assert (bus.kind, bus.severity) == ("xid", "critical")
    assert bus.attrs == {
        "pci": "0000:c6:00",
        "xid": 79,
        "pid": 1101234,
        "process": "nvc:[driver]",
        "action": "RESTART_BM",
        "mnemonic": "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS",
        "kmsg_seq": 3,
    }
    assert bus.message.startswith("NVRM: Xid (PCI:0000:c6:00): 79")
    assert gsp.attrs["xid"] == 154 and gsp.attrs["action"] == "RESET_GPU"
    assert gsp.attrs["recovery_action"] == "GPU Reset Required"
    fits_a_batch(samples)


async def test_xid_collector_reads_a_fifo_and_waits_for_whole_records(tmp_path: Path) -> None:
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    collector = XidCollector(kmsg_path=fifo, journal_cmd=None)
    writer = None
    try:
        assert (await collector.collect()).events == []  # opens the reading end
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        record = kmsg(10, XID_LINES["mmu"])
        os.write(writer, record[:25])
        assert (await collector.collect()).events == []
        os.write(writer, record[25:] + b"\xff\xfe junk that is not a record\n")
        samples = await collect_until(collector, 1)
    finally:
        if writer is not None:
            os.close(writer)
        await collector.close()
    (mmu,) = samples.events
    assert (mmu.attrs["xid"], mmu.attrs["pid"], mmu.attrs["process"]) == (
        31,
        13332,
        "cuda_plot_k32_v",
    )
    assert mmu.severity == "warning" and mmu.attrs["kmsg_seq"] == 10


async def test_xid_collector_falls_back_to_a_journal_process(tmp_path: Path) -> None:
    journal = FIXTURES / "xid" / "nvidia_forum_364958_gsp.log"
    collector = XidCollector(
        kmsg_path=tmp_path / "no-such-kmsg",
        journal_cmd=["cat", str(journal)],
    )
    try:
        samples = await collect_until(collector, 5)
        assert collector.source in ("journal", "none")  # "none" once cat has exited
    finally:
        await collector.close()
    assert [e.attrs["xid"] for e in samples.events] == [120, 154, 62, 154, 45]
    assert samples.events[4].attrs["process"] == "VLLM::Worker"
    fits_a_batch(samples)


async def test_xid_collector_without_any_source_reports_nothing_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    collector = XidCollector(
        kmsg_path=tmp_path / "no-such-kmsg",
        journal_cmd=[str(tmp_path / "no-such-journalctl"), "-k"],
    )
    with caplog.at_level(logging.WARNING, logger="agents.collectors.xid"):
        assert (await collector.collect()).events == []
        assert (await collector.collect()).events == []
    assert collector.source == "none"
    await collector.close()
    assert len([r for r in caplog.records if "no kernel log source" in r.message]) == 1


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg is not readable here")
async def test_xid_collector_opens_the_real_dev_kmsg() -> None:
    collector = XidCollector(journal_cmd=None)
    try:
        samples = await collector.collect()
        # Only records written after the start are read, and this host is not
        # expected to log Xids while the test runs.
        assert collector.source in ("kmsg", "none")
        assert all(e.kind == "xid" for e in samples.events)
    finally:
        await collector.close()


# ------------------------------------------------------------ NcclLogCollector


async def test_nccl_collector_starts_at_the_end_then_follows(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    old = nccl_lines("ofa_271_v100.log")
    log.write_text("\n".join(old) + "\n")
    collector = NcclLogCollector([str(tmp_path / "*.log")], job="llama-70b")
    try:
        assert (await collector.collect()).events == []
        append(log, "\n".join(nccl_lines("llamafactory_7396_numbered.log")) + "\n")
        samples = await collector.collect()
    finally:
        await collector.close()
    timeouts = [e for e in samples.events if e.kind == "nccl_timeout"]
    assert [(e.rank, e.attrs["seq"]) for e in timeouts] == [(0, 1580), (4, 1580)]
    first = timeouts[0]
    assert first.job == "llama-70b" and first.severity == "error"
    assert first.attrs["op"] == "ALLREDUCE"
    assert (first.attrs["timeout_ms"], first.attrs["ran_ms"]) == (600000, 600060)
    assert first.attrs["reason"] == "watchdog_timeout"
    assert first.attrs["file"] == str(log)
    status = [e for e in samples.events if e.kind == "nccl_error"]
    assert [(e.rank, e.attrs["pg"], e.attrs["last_completed"]) for e in status] == [
        (0, "1", 1579),
        (3, "1", 1579),
    ]
    fits_a_batch(samples)


async def test_nccl_collector_replays_from_start_and_picks_up_new_files(tmp_path: Path) -> None:
    (tmp_path / "a.log").write_text("\n".join(nccl_lines("nccl_795_socket.log")) + "\n")
    collector = NcclLogCollector([str(tmp_path / "*.log")], from_start=True)
    try:
        first = await collector.collect()
        assert [e.attrs["reason"] for e in first.events] == [
            "socket_call_failed",
            "proxy_operation_failed",
            "connection_closed_by_peer",
        ]
        assert first.events[2].attrs["host"] == "a100-st-p4d24xlarge-22"
        # A file that appears later is read from its beginning.
        (tmp_path / "b.log").write_text("\n".join(nccl_lines("nccl_1405_ib_status12.log")) + "\n")
        second = await collector.collect()
    finally:
        await collector.close()
    assert [(e.attrs["reason"], e.attrs["status"]) for e in second.events] == [
        ("ib_completion_error", 12),
        ("ib_completion_error", 12),
    ]
    assert all(e.attrs["file"] == str(tmp_path / "b.log") for e in second.events)


async def test_nccl_collector_keeps_a_partial_line_until_its_newline(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"")
    line = nccl_lines("deepspeed_7533_terminated.log")[2].encode()
    collector = NcclLogCollector([str(log)])
    try:
        await collector.collect()
        append(log, line[:120])
        assert (await collector.collect()).events == []
        append(log, line[120:])
        assert (await collector.collect()).events == []  # still no newline
        append(log, b"\n")
        samples = await collector.collect()
    finally:
        await collector.close()
    (term,) = samples.events
    assert term.message == line.decode()
    assert (term.rank, term.severity, term.attrs["seq"]) == (5, "critical", 460631)


async def test_nccl_collector_follows_rotation_without_losing_or_repeating(
    tmp_path: Path,
) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"")
    ofa = nccl_lines("ofa_271_v100.log")  # ranks 1, 3, 2, 6, 7
    for pattern in ("train.log", "train.log*"):
        collector = NcclLogCollector([str(tmp_path / pattern)])
        try:
            await collector.collect()
            append(log, ofa[0] + "\n")
            assert [e.rank for e in (await collector.collect()).events] == [1]
            # The writer still appends to the old file while it is renamed away,
            # then a new file takes the name.
            with open(log, "ab") as writer:
                writer.write((ofa[1] + "\n").encode())
                log.rename(tmp_path / "train.log.1")
                writer.write((ofa[2] + "\n").encode())
            log.write_text(ofa[3] + "\n" + ofa[4] + "\n")
            ranks = [e.rank for e in (await collector.collect()).events]
            assert ranks == [3, 2, 6, 7], pattern
            append(log, ofa[0] + "\n")
            append(tmp_path / "train.log.1", ofa[0] + "\n")
            later = [e.rank for e in (await collector.collect()).events]
            # "train.log*" still follows the rotated file; "train.log" does not.
            assert later == ([1, 1] if pattern.endswith("*") else [1]), pattern
        finally:
            await collector.close()
            (tmp_path / "train.log.1").unlink()
            log.write_bytes(b"")


async def test_nccl_collector_rereads_a_truncated_file(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"")
    collector = NcclLogCollector([str(log)])
    try:
        await collector.collect()
        append(log, "\n".join(nccl_lines("pytorch_118369_deepspeed_broadcast.log")) + "\n")
        assert len((await collector.collect()).events) == 4
        # copytruncate: the file is emptied in place and the job writes on.
        with open(log, "r+b") as f:
            f.truncate(0)
        append(log, nccl_lines("megatron_71_title.log")[0] + "\n")
        samples = await collector.collect()
    finally:
        await collector.close()
    (err,) = samples.events
    assert err.attrs["reason"] == "unhandled_system_error"
    assert err.attrs["nccl_version"] == "2.8.3"


async def test_nccl_collector_survives_binary_junk(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"")
    collector = NcclLogCollector([str(log)], default_rank=12)
    try:
        await collector.collect()
        junk = bytes(range(256)) * 40  # NUL, invalid UTF-8, stray newlines
        append(log, junk + b"\n")
        append(log, nccl_lines("nccl_1141_title.log")[0].encode() + b"\n")
        append(
            log, b"\xc3\x28\xa0\xa1 " + nccl_lines("megatron_1207_title.log")[0].encode() + b"\n"
        )
        samples = await collector.collect()
    finally:
        await collector.close()
    assert [e.attrs["reason"] for e in samples.events] == ["remote_error", "watchdog_timeout"]
    # Neither line names a rank: the configured default applies.
    assert [e.rank for e in samples.events] == [12, 12]
    assert "\ufffd" in samples.events[1].message
    fits_a_batch(samples)


async def test_nccl_collector_maps_local_ranks_with_the_rank_offset(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    log.write_bytes(b"")
    collector = NcclLogCollector([str(log)], job="job-7", rank_offset=8, default_rank=0)
    try:
        await collector.collect()
        append(log, "\n".join(nccl_lines("pytorch_126544_elastic_agent.log")) + "\n")
        append(log, "\n".join(nccl_lines("mmsegmentation_3106_elastic.log")) + "\n")
        samples = await collector.collect()
    finally:
        await collector.close()
    failed = [e for e in samples.events if e.attrs["reason"] == "worker_failed"]
    # The agent line names only local_rank 0 -> 8 + 0; the summary names global ranks.
    assert [e.rank for e in failed] == [8, 1, 2]
    assert failed[1].attrs["host"] == "neptun.informatik.uni-kl.de"
    assert failed[1].attrs["signal"] == "SIGABRT"


async def test_nccl_collector_takes_the_agent_config_name_for_globs(tmp_path: Path) -> None:
    (tmp_path / "r.log").write_text(nccl_lines("megatron_71_title.log")[0] + "\n")
    collector = NcclLogCollector(nccl_log_globs=[str(tmp_path / "*.log")], from_start=True)
    try:
        (err,) = (await collector.collect()).events
    finally:
        await collector.close()
    assert err.attrs["reason"] == "unhandled_system_error"


def test_nccl_collector_refuses_bad_configuration() -> None:
    with pytest.raises(ValueError):
        NcclLogCollector([])
    with pytest.raises(ValueError):
        NcclLogCollector(["/tmp/x.log"], job="has space")


def test_collectors_are_named_for_the_registry() -> None:
    assert XidCollector.name == "xid"
    assert NcclLogCollector.name == "nccl"
