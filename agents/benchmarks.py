"""Benchmarks the agent runs when the backend bisects for a slow node.

Each returns one figure, higher is better: GFLOP/s of a matrix multiply,
Gbit/s of one TCP hop of a ring, or a figure parsed out of an operator's own
command (e.g. nccl-tests' bus bandwidth). Each has a deadline and raises
:class:`BenchmarkTimeout` past it, so a stuck node fails its group instead of
holding up the bisection.

This module belongs to the agent: it never imports ``app``. numpy and torch
are imported when a benchmark needs them, so the agent starts without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import struct
import time
from collections.abc import Callable, Sequence

RING_MAGIC = b"MWR1"
_HEADER = struct.Struct("!4sQ")  # magic, payload bytes
_ACK = struct.Struct("!4sd")  # magic, receiver's seconds from first to last byte
_PACED_CHUNK = 64 * 1024
_CHUNK = 1 << 20
_CONNECT_RETRY_S = 0.05

# nccl-tests prints "# Avg bus bandwidth    : 84.8558" (older releases without "#").
NCCL_TESTS_AVG_BUSBW = r"^\s*#?\s*Avg bus bandwidth\s*:\s*([0-9]+(?:\.[0-9]+)?)"


class BenchmarkError(RuntimeError):
    """A benchmark could not produce a figure."""


class BenchmarkTimeout(BenchmarkError, TimeoutError):
    """A benchmark ran past its deadline (its processes, if any, were killed)."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


# -- gemm ---------------------------------------------------------------------


def _gemm_torch(size: int, seconds: float) -> float | None:
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.randn(size, size, device="cuda", dtype=torch.float32)
    b = torch.randn(size, size, device="cuda", dtype=torch.float32)
    torch.matmul(a, b)  # warm-up: kernel selection and lazy init are not throughput
    torch.cuda.synchronize()
    count, start = 0, time.perf_counter()
    while True:
        for _ in range(8):  # batches: a synchronize per matmul would measure the launch latency
            torch.matmul(a, b)
        torch.cuda.synchronize()
        count += 8
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * size**3 * count / elapsed / 1e9


def _gemm_numpy(size: int, seconds: float) -> float:
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    out = np.empty_like(a)
    np.matmul(a, b, out=out)  # warm-up
    count, start = 0, time.perf_counter()
    while True:
        np.matmul(a, b, out=out)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * size**3 * count / elapsed / 1e9


async def run_gemm(size: int = 2048, seconds: float = 2.0) -> float:
    """GFLOP/s of repeated float32 ``size x size`` matrix multiplies for about ``seconds``.

    Runs on the GPU when torch with CUDA is importable, else with numpy on the
    CPU; in a thread, so the agent keeps reporting meanwhile.
    """
    if size < 1 or seconds <= 0:
        raise ValueError("size and seconds must be positive")
    figure = await asyncio.to_thread(_gemm_torch, size, seconds)
    if figure is None:
        figure = await asyncio.to_thread(_gemm_numpy, size, seconds)
    return figure


# -- net-ring -----------------------------------------------------------------


def _gbits(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / max(seconds, 1e-9) / 1e9


async def net_ring_send(
    to_host: str,
    to_port: int,
    nbytes: int,
    timeout: float = 30.0,
    rate_bps: float | None = None,
) -> float:
    """Send ``nbytes`` over one TCP stream to a ring peer; Gbit/s until it acknowledged all.

    The peer may start a little later (ring members start at slightly
    different times), so refused connections are retried until the deadline.
    With ``rate_bps`` the writes are paced so the stream never runs faster:
    the receiver sees a real TCP stream at that rate, which is how a lab
    makes one node's network slow.
    """
    if nbytes < 1:
        raise ValueError("nbytes must be positive")
    if rate_bps is not None and rate_bps <= 0:
        raise ValueError("rate_bps must be positive")
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    reader, writer = await asyncio.open_connection(to_host, to_port)
                    break
                except OSError:
                    await asyncio.sleep(_CONNECT_RETRY_S)
            try:
                start = time.perf_counter()
                writer.write(_HEADER.pack(RING_MAGIC, nbytes))
                # Paced streams write small pieces so the rate holds from the start.
                chunk = _PACED_CHUNK if rate_bps is not None else _CHUNK
                block = memoryview(bytes(min(chunk, nbytes)))
                sent = 0
                while sent < nbytes:
                    piece = block[: min(nbytes - sent, len(block))]
                    writer.write(piece)
                    sent += len(piece)
                    await writer.drain()
                    if rate_bps is not None:
                        ahead = start + sent * 8 / rate_bps - time.perf_counter()
                        if ahead > 0:
                            await asyncio.sleep(ahead)
                magic, _ = _ACK.unpack(await reader.readexactly(_ACK.size))
                elapsed = time.perf_counter() - start
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except TimeoutError:
        raise BenchmarkTimeout(
            f"net-ring send to {to_host}:{to_port} not done within {timeout}s"
        ) from None
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise BenchmarkError(f"net-ring peer {to_host}:{to_port} broke the stream: {exc}") from exc
    if magic != RING_MAGIC:
        raise BenchmarkError(f"net-ring peer {to_host}:{to_port} answered garbage")
    return _gbits(nbytes, elapsed)


async def net_ring_receive(
    bind_host: str,
    port: int,
    nbytes: int,
    timeout: float,
    on_listening: Callable[[int], None] | None = None,
) -> float:
    """Receive ``nbytes`` from a ring peer on one TCP stream; Gbit/s from first to last byte.

    ``port`` 0 picks a free port; ``on_listening`` is told the bound port. A
    connection that does not speak the ring protocol or announces another
    size is dropped and the wait goes on until the deadline.
    """
    if nbytes < 1:
        raise ValueError("nbytes must be positive")
    loop = asyncio.get_running_loop()
    result: asyncio.Future[float] = loop.create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = await reader.readexactly(_HEADER.size)
            magic, announced = _HEADER.unpack(header)
            if magic != RING_MAGIC or announced != nbytes or result.done():
                return
            left = nbytes
            first = await reader.read(min(_CHUNK, left))
            if not first:
                return
            start = time.perf_counter()
            left -= len(first)
            while left:
                data = await reader.read(min(_CHUNK, left))
                if not data:
                    return  # the sender went away: keep waiting for a proper one
                left -= len(data)
            elapsed = time.perf_counter() - start
            writer.write(_ACK.pack(RING_MAGIC, elapsed))
            await writer.drain()
            if not result.done():
                # The first byte's own transfer is not in the interval: count what followed.
                result.set_result(_gbits(nbytes - len(first), elapsed))
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    server = await asyncio.start_server(handle, bind_host, port)
    try:
        bound = server.sockets[0].getsockname()[1]
        if on_listening is not None:
            on_listening(bound)
        try:
            return await asyncio.wait_for(asyncio.shield(result), timeout)
        except TimeoutError:
            raise BenchmarkTimeout(
                f"net-ring receive on {bind_host}:{bound}: no complete {nbytes}-byte stream "
                f"within {timeout}s"
            ) from None
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1.0)


# -- operator command ---------------------------------------------------------


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_command(argv: Sequence[str], pattern: str, timeout: float) -> float:
    """Run an operator's benchmark command and return the figure its output reports.

    ``pattern`` is a regular expression (multi-line mode) whose first group
    (or group named ``figure``) is the number; the last match counts, since
    tools such as nccl-tests print their summary at the end. The command runs
    in its own process group; past ``timeout`` the whole group (mpirun and its
    ranks) is killed and :class:`BenchmarkTimeout` raised. A non-zero exit
    status or output without a match raises :class:`BenchmarkError`.
    """
    regex = re.compile(pattern, re.MULTILINE)
    if not argv:
        raise ValueError("argv is empty")
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # its own process group, so a timeout kills every child
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        _kill_group(proc.pid)
        await proc.wait()
        raise BenchmarkTimeout(
            f"{argv[0]} did not finish within {timeout}s; its process group was killed",
            pid=proc.pid,
        ) from None
    except BaseException:
        _kill_group(proc.pid)  # cancelled: leave no benchmark running behind us
        raise
    text = out.decode("utf-8", errors="replace")
    tail = text[-2000:]
    if proc.returncode != 0:
        raise BenchmarkError(f"{argv[0]} exited with status {proc.returncode}: {tail}")
    matches = list(regex.finditer(text))
    if not matches:
        raise BenchmarkError(f"{argv[0]} output has no match for {pattern!r}: {tail}")
    last = matches[-1]
    raw = last.group("figure") if "figure" in regex.groupindex else last.group(1)
    try:
        return float(raw)
    except (TypeError, ValueError):
        raise BenchmarkError(f"{argv[0]}: matched {raw!r}, which is not a number") from None
