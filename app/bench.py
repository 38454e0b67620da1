"""``meshwatch bench ...``: figures, not assertions.

``bench ingest`` drives a running server over HTTP with N simulated agents,
each sending one realistic batch a second (P peers x 4 flows of probe stats,
8 GPUs, 2 NICs), and prints sustained rows/s, batches/s and ingest latency.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

FLOWS = 4
GPUS = 8
NIC_COUNTERS = (
    "rx_bytes",
    "tx_bytes",
    "rx_prio3_pause",
    "tx_prio3_pause",
    "rx_prio3_pause_duration",
    "tx_prio3_pause_duration",
    "out_of_buffer",
    "np_cnp_sent",
)


def synthetic_batch(node: str, seq: int, peers: list[str], rng: random.Random) -> dict[str, Any]:
    """One second of a healthy GPU node, shaped like a real agent's batch."""
    ts = datetime.now(UTC).isoformat()
    probes = []
    for peer in peers:
        for flow in range(FLOWS):
            rtt = rng.gauss(45.0, 4.0)
            probes.append(
                {
                    "ts": ts,
                    "peer": peer,
                    "flow": flow,
                    "sent": 1,
                    "received": 1,
                    "rtt_min_us": rtt,
                    "rtt_p50_us": rtt,
                    "rtt_max_us": rtt,
                }
            )
    gpus = [
        {
            "ts": ts,
            "gpu": g,
            "util_pct": rng.uniform(90, 100),
            "mem_used_bytes": 70 << 30,
            "temp_c": rng.uniform(55, 70),
            "power_w": rng.uniform(500, 700),
            "sm_clock_mhz": 1980.0,
            "throttle_reasons": 0,
            "ecc_volatile_sbe": 0,
            "ecc_volatile_dbe": 0,
            "pcie_replay": 0,
        }
        for g in range(GPUS)
    ]
    nics = [
        {"ts": ts, "iface": f"mlx5_{i}", "counter": c, "value": float(seq * 1000), "rate": 1000.0}
        for i in range(2)
        for c in NIC_COUNTERS
    ]
    hosts = [
        {
            "ts": ts,
            "cpu_pct": rng.uniform(5, 30),
            "load1": 4.0,
            "mem_total_bytes": 2 << 40,
            "mem_available_bytes": 1 << 40,
        }
    ]
    return {
        "node": node,
        "seq": seq,
        "sent_at": ts,
        "probes": probes,
        "gpus": gpus,
        "nics": nics,
        "hosts": hosts,
        "events": [],
    }


def batch_rows(batch: dict[str, Any]) -> int:
    return sum(len(batch[k]) for k in ("probes", "gpus", "nics", "hosts", "events"))


async def bench_ingest(
    server: str, bootstrap: str, agents: int, peers: int, seconds: float, run_id: str
) -> dict[str, Any]:
    import httpx

    names = [f"bench-{run_id}-{i:04d}" for i in range(agents)]
    latencies: list[float] = []
    rows = batches = errors = 0
    limits = httpx.Limits(max_connections=agents, max_keepalive_connections=agents)
    async with httpx.AsyncClient(base_url=server, timeout=30, limits=limits) as client:
        tokens = {}
        for i, name in enumerate(names):
            r = await client.post(
                "/api/v1/nodes/register",
                headers={"Authorization": f"Bearer {bootstrap}"},
                json={
                    "node": name,
                    "hostname": name,
                    "address": f"198.18.{i // 250}.{i % 250 + 1}",
                    "rack": f"bench-tor-{i // 16}",
                    "gpu_count": GPUS,
                },
            )
            r.raise_for_status()
            tokens[name] = r.json()["token"]
        start = time.monotonic()
        deadline = start + seconds

        async def agent(idx: int, name: str) -> None:
            nonlocal rows, batches, errors
            rng = random.Random(idx)
            peer_names = [names[(idx + k + 1) % agents] for k in range(peers)]
            headers = {
                "Authorization": f"Bearer {tokens[name]}",
                "Content-Encoding": "gzip",
                "Content-Type": "application/json",
            }
            seq = 0
            # Spread agents over the second as real ones are.
            await asyncio.sleep(rng.random())
            next_at = time.monotonic()
            while time.monotonic() < deadline:
                batch = synthetic_batch(name, seq, peer_names, rng)
                body = gzip.compress(json.dumps(batch).encode(), compresslevel=1)
                t0 = time.perf_counter()
                try:
                    r = await client.post("/api/v1/ingest", content=body, headers=headers)
                except httpx.HTTPError:
                    errors += 1  # an overloaded server drops connections: count, go on
                    seq += 1
                    next_at += 1.0
                    continue
                latencies.append(time.perf_counter() - t0)
                if r.status_code == 200:
                    rows += batch_rows(batch)
                    batches += 1
                else:
                    errors += 1
                seq += 1
                next_at += 1.0
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))

        await asyncio.gather(*(agent(i, n) for i, n in enumerate(names)))
        elapsed = time.monotonic() - start
    latencies.sort()
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else latencies * 99
    return {
        "agents": agents,
        "peers": peers,
        "seconds": round(elapsed, 1),
        "offered_batches_per_s": agents,
        "batches_per_s": round(batches / elapsed, 1),
        "rows_per_s": round(rows / elapsed),
        "rows_per_batch": batch_rows(synthetic_batch("x", 0, ["y"] * peers, random.Random(0))),
        "errors": errors,
        "latency_p50_ms": round(q[49] * 1000, 1),
        "latency_p99_ms": round(q[98] * 1000, 1),
    }


def _bootstrap(args: argparse.Namespace) -> str:
    if args.bootstrap_token:
        return args.bootstrap_token
    path = Path(args.data_dir) / "secrets.json"
    return json.loads(path.read_text())["bootstrap_token"]


def cmd_bench_ingest(args: argparse.Namespace) -> int:
    result = asyncio.run(
        bench_ingest(
            args.server,
            _bootstrap(args),
            args.agents,
            args.peers,
            args.seconds,
            args.run_id or f"{int(time.time()) % 100000}",
        )
    )
    _print(result, args.json)
    return 0


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, default=str))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v}")


def cmd_bench_probe(args: argparse.Namespace) -> int:
    from agents.probes.prober import measure_overhead

    _print(measure_overhead(peers=args.peers, seconds=args.seconds, flows=args.flows), args.json)
    return 0


def cmd_bench_localize(args: argparse.Namespace) -> int:
    from app.analysis.pingmesh import benchmark_localizer

    result = benchmark_localizer(args.nodes, args.tors, args.peers, evaluations=args.evaluations)
    _print(result, args.json)
    return 0


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="measure throughput and latency; prints figures")
    bsub = bench.add_subparsers(dest="bench", required=True)
    p = bsub.add_parser(
        "ingest", help="N simulated agents send one batch a second to a running server"
    )
    p.add_argument("--server", default="http://127.0.0.1:8080")
    p.add_argument("--agents", type=int, default=50)
    p.add_argument("--peers", type=int, default=64)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--bootstrap-token", help="default: read from DATA_DIR/secrets.json")
    p.add_argument("--data-dir", default=".meshwatch")
    p.add_argument("--run-id", help="suffix of the simulated node names")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_ingest)

    p = bsub.add_parser("probe", help="CPU and memory of one agent prober at 1 Hz on loopback")
    p.add_argument("--peers", type=int, default=64)
    p.add_argument("--flows", type=int, default=4)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_probe)

    p = bsub.add_parser("localize", help="ping-mesh localisation time on a synthetic cluster")
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--tors", type=int, default=25)
    p.add_argument("--peers", type=int, default=64)
    p.add_argument("--evaluations", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_localize)
