"""The agent's task runner on real sockets and real processes (no backend needed)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.benchmarks import NCCL_TESTS_AVG_BUSBW, net_ring_receive, net_ring_send
from agents.tasks import TaskRunner, run_budget

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nccl_tests"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runner(client: httpx.AsyncClient, node: str, **options: Any) -> TaskRunner:
    return TaskRunner("http://127.0.0.1:9", node, lambda: "unused", client,
                      bind_host="127.0.0.1", **options)


@pytest.fixture
async def client():  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient() as c:
        yield c


def ring_tasks(ports: dict[str, int], nbytes: int) -> dict[str, dict[str, Any]]:
    members = list(ports)
    out = {}
    for i, node in enumerate(members):
        succ = members[(i + 1) % len(members)]
        out[node] = {
            "id": i + 1, "kind": "net-ring", "timeout_s": 30.0,
            "spec": {"nbytes": nbytes, "port": ports[node], "receive_from": members[i - 1],
                     "send_to": {"node": succ, "address": "127.0.0.1", "port": ports[succ]},
                     "members": members},
        }
    return out


async def test_net_ring_task_measures_each_incoming_hop(client: httpx.AsyncClient) -> None:
    ports = {"a": free_port(), "b": free_port(), "c": free_port()}
    tasks = ring_tasks(ports, 8 << 20)
    runners = {n: runner(client, n) for n in ports}
    results = await asyncio.gather(*(runners[n].run_task(tasks[n]) for n in ports))
    for node, result in zip(ports, results, strict=True):
        assert "error" not in result, result
        assert result["figure"] > 0
        assert result["figure"] == result["detail"]["receive_gbps"]
        assert result["detail"]["from"] == tasks[node]["spec"]["receive_from"]


async def test_send_rate_limit_throttles_the_real_stream(client: httpx.AsyncClient) -> None:
    cap_bps = 200e6
    ports = {"fast": free_port(), "capped": free_port()}
    tasks = ring_tasks(ports, 4 << 20)
    fast = runner(client, "fast")
    capped = runner(client, "capped", send_rate_limit_bps=cap_bps)
    on_fast, on_capped = await asyncio.gather(fast.run_task(tasks["fast"]),
                                              capped.run_task(tasks["capped"]))
    # The hop out of the capped node is measured by its successor: at most the cap.
    assert on_fast["figure"] * 1e9 <= cap_bps * 1.1
    assert on_capped["detail"]["send_gbps"] * 1e9 <= cap_bps * 1.1
    assert on_capped["detail"]["send_rate_limit_bps"] == cap_bps


async def test_paced_send_speaks_the_ring_protocol() -> None:
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    receive = asyncio.create_task(
        net_ring_receive("127.0.0.1", 0, 4 << 20, 20, on_listening=bound.set_result))
    port = await asyncio.wait_for(bound, 5)
    sent = await net_ring_send("127.0.0.1", port, 4 << 20, timeout=20, rate_bps=100e6)
    assert 0 < sent <= 0.11 and 0 < await receive <= 0.11


async def test_net_ring_task_without_a_successor_fails_within_its_budget(
        client: httpx.AsyncClient) -> None:
    task = ring_tasks({"lonely": free_port(), "absent": free_port()}, 1 << 20)["lonely"]
    task["timeout_s"] = 1.0
    result = await runner(client, "lonely").run_task(task)
    assert "figure" not in result
    assert "BenchmarkTimeout" in result["error"]


async def test_command_task_needs_the_program_allowed(client: httpx.AsyncClient) -> None:
    task = {"id": 7, "kind": "command", "timeout_s": 20.0,
            "spec": {"argv": ["cat", str(FIXTURES / "all_reduce_perf_issue119_tail.txt")],
                     "pattern": NCCL_TESTS_AVG_BUSBW}}
    refused = await runner(client, "n").run_task(task)
    assert "not allowed" in refused["error"]
    allowed = await runner(client, "n", allowed_commands=["cat"]).run_task(task)
    assert allowed["figure"] == pytest.approx(84.8558)


async def test_gemm_task_and_unknown_kind(client: httpx.AsyncClient) -> None:
    r = runner(client, "n")
    gemm = await r.run_task({"id": 1, "kind": "gemm", "timeout_s": 20.0,
                             "spec": {"size": 128, "seconds": 0.1}})
    assert gemm["figure"] > 0
    too_long = await r.run_task({"id": 2, "kind": "gemm", "timeout_s": 1.0,
                                 "spec": {"size": 128, "seconds": 5}})
    assert "does not fit" in too_long["error"]
    unknown = await r.run_task({"id": 3, "kind": "fio", "timeout_s": 5.0, "spec": {}})
    assert "unknown task kind" in unknown["error"]


def test_run_budget_leaves_time_to_post() -> None:
    assert run_budget(60.0) == 58.0
    assert run_budget(5.0) == 4.5
    assert run_budget(0.0) == 0.1


async def test_poll_against_an_absent_backend_raises_and_stop_ends_run_forever(
        client: httpx.AsyncClient) -> None:
    r = TaskRunner(f"http://127.0.0.1:{free_port()}", "n", lambda: "t", client, wait_s=0,
                   retry_base_s=0.01, retry_cap_s=0.05)
    with pytest.raises(httpx.ConnectError):
        await r.poll_once()
    loop = asyncio.create_task(r.run_forever())
    await asyncio.sleep(0)  # let it start polling (and failing, and retrying)
    await r.stop()
    await asyncio.wait_for(loop, 5)
    assert loop.done() and loop.exception() is None
