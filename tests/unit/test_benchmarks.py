"""Agent-side benchmarks: real matrix multiplies, real TCP, real processes."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from agents.benchmarks import (
    NCCL_TESTS_AVG_BUSBW,
    BenchmarkError,
    BenchmarkTimeout,
    net_ring_receive,
    net_ring_send,
    run_command,
    run_gemm,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nccl_tests"


async def test_gemm_returns_a_positive_gflops_figure() -> None:
    figure = await run_gemm(size=256, seconds=0.2)
    assert figure > 0


async def test_gemm_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        await run_gemm(size=0)


async def _listening_receiver(nbytes: int, timeout: float) -> tuple[asyncio.Task[float], int]:
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        net_ring_receive("127.0.0.1", 0, nbytes, timeout, on_listening=bound.set_result)
    )
    port = await asyncio.wait_for(bound, 5)
    return task, port


async def test_net_ring_hop_over_loopback_tcp() -> None:
    nbytes = 64 << 20
    receiver, port = await _listening_receiver(nbytes, timeout=30)

    sent, received = await asyncio.gather(
        net_ring_send("127.0.0.1", port, nbytes, timeout=30), receiver
    )

    assert sent > 0
    assert received > 0


async def test_net_ring_three_node_ring_on_loopback() -> None:
    # Each "node" receives from its predecessor and sends to its successor at once.
    nbytes = 8 << 20
    receivers = [await _listening_receiver(nbytes, timeout=30) for _ in range(3)]
    senders = [
        net_ring_send("127.0.0.1", receivers[(i + 1) % 3][1], nbytes, timeout=30) for i in range(3)
    ]
    figures = await asyncio.gather(*senders, *(task for task, _ in receivers))
    assert len(figures) == 6 and all(f > 0 for f in figures)


async def test_net_ring_sender_waits_for_a_late_receiver() -> None:
    # Find a free port, then start the receiver on it only after the sender began.
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()

    send = asyncio.create_task(net_ring_send("127.0.0.1", port, 1 << 20, timeout=20))
    # The receiver is late on purpose: the sender retries refused connections meanwhile.
    await asyncio.sleep(0.2)
    assert not send.done()
    received = await net_ring_receive("127.0.0.1", port, 1 << 20, timeout=20)
    assert received > 0 and await send > 0


async def test_net_ring_send_deadline_when_the_receiver_never_appears() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()

    started = time.monotonic()
    with pytest.raises(BenchmarkTimeout, match="not done within"):
        await net_ring_send("127.0.0.1", port, 1 << 20, timeout=0.5)
    assert time.monotonic() - started < 10


async def test_net_ring_receive_deadline_when_no_sender_comes() -> None:
    with pytest.raises(BenchmarkTimeout, match="no complete"):
        await net_ring_receive("127.0.0.1", 0, 1 << 20, timeout=0.3)


async def test_net_ring_receiver_ignores_a_stray_connection() -> None:
    nbytes = 1 << 20
    receiver, port = await _listening_receiver(nbytes, timeout=20)
    _, stray = await asyncio.open_connection("127.0.0.1", port)
    stray.write(b"GET / HTTP/1.0\r\n\r\n")  # not the ring protocol
    await stray.drain()
    stray.close()
    assert await net_ring_send("127.0.0.1", port, nbytes, timeout=20) > 0
    assert await receiver > 0


async def test_run_command_parses_busbw_from_real_all_reduce_perf_output() -> None:
    path = FIXTURES / "all_reduce_perf_issue119_tail.txt"
    figure = await run_command(["cat", str(path)], NCCL_TESTS_AVG_BUSBW, timeout=10)
    assert figure == pytest.approx(84.8558)


async def test_run_command_parses_older_nccl_tests_summary() -> None:
    path = FIXTURES / "all_gather_perf_issue37.txt"
    figure = await run_command(["cat", str(path)], NCCL_TESTS_AVG_BUSBW, timeout=10)
    assert figure == pytest.approx(128.942)


async def test_run_command_last_match_and_named_group() -> None:
    # The busbw column of the largest message size: the last table row.
    path = FIXTURES / "all_reduce_perf_issue119_tail.txt"
    row = r"^\s+\d+\s+\d+\s+float\s+sum\s+-?\d+\s+\S+\s+\S+\s+(?P<figure>[0-9.]+)"
    assert await run_command(["cat", str(path)], row, timeout=10) == pytest.approx(95.74)


async def test_run_command_without_a_match_or_with_failure_raises() -> None:
    with pytest.raises(BenchmarkError, match="no match"):
        await run_command(["echo", "nothing here"], NCCL_TESTS_AVG_BUSBW, timeout=10)
    with pytest.raises(BenchmarkError, match="status 3"):
        await run_command(
            [sys.executable, "-c", "import sys; print('# Avg bus bandwidth : 1.0'); sys.exit(3)"],
            NCCL_TESTS_AVG_BUSBW,
            timeout=10,
        )


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"  # killed, waiting for init to reap it


async def test_run_command_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    script = f"sleep 60 & echo $! > {pidfile}; wait"

    with pytest.raises(BenchmarkTimeout, match="process group was killed") as info:
        await run_command(["sh", "-c", script], NCCL_TESTS_AVG_BUSBW, timeout=1.0)

    assert info.value.pid is not None
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while not _gone(child):
        assert time.monotonic() < deadline, "the grandchild survived the timeout"
        await asyncio.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.kill(info.value.pid, 0)  # the leader was reaped
