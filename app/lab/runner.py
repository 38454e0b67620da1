"""``meshwatch lab run``: a real cluster in network namespaces, a real fault,
and how long meshwatch took to name it.

Steps: build the lab (nodes, ToR bridges, spine, management network), start
the backend on the management network, start one real agent in every node
namespace, wait for a healthy baseline (every agent reporting, probes
flowing, no open incident), inject the fault on the fabric, and wait for
the incident that names it. Everything is torn down on success, error or
Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from app.lab import faults
from app.lab.processes import BackendProcess, agent_command
from app.lab.topology import Lab, destroy_leftovers

LAB_PREFIX = "mwl"
PFC_STORM_PPS = 2000


@dataclass
class Expectation:
    """What a scenario's incident must say: its kind and top suspect."""

    kinds: tuple[str, ...]
    suspect_type: str
    suspect_id: str
    # Accept the target tied with the top suspect (see ``met_by``).
    allow_ties: bool = False

    def met_by(self, incident: dict[str, Any]) -> bool:
        """The target is the top suspect; or, with ``allow_ties``, tied with it: with
        two ToRs either uplink (or the spine) explains the cross-ToR loss equally
        well, and the incident says so by scoring them alike rather than guessing."""
        if incident["kind"] not in self.kinds or not incident["suspects"]:
            return False
        top = incident["suspects"][0]
        if not self.allow_ties:
            return (top["type"], top["id"]) == (self.suspect_type, self.suspect_id)
        return any(
            s["type"] == self.suspect_type
            and s["id"] == self.suspect_id
            and s["score"] >= top["score"] - 1e-6
            for s in incident["suspects"]
        )


@dataclass
class Scenario:
    name: str
    target_kind: str  # "node" or "tor"
    help: str
    # inject(lab, target, ctx) -> Expectation | None (None: expect nothing)
    inject: Callable[[Lab, str, RunContext], Expectation | None]
    # Extra agent flags per node: (lab, node id, work folder) -> flags.
    agent_flags: Callable[[Lab, str, Path], list[str]] = lambda lab, node, workdir: []
    # Scenarios found by active measurement rather than by an incident wait on
    # their own: (run, api, ctx, target, t0) -> result fields.
    detect: Callable[..., dict[str, Any]] | None = None
    collectors: str = "host,pingmesh"
    default_timeout_s: float = 30.0


@dataclass
class RunContext:
    lab: Lab
    backend: BackendProcess
    workdir: Path
    cleanups: list[Callable[[], None]] = field(default_factory=list)


def _node_down(lab: Lab, target: str, ctx: RunContext) -> Expectation:
    faults.node_down(lab, target)
    return Expectation(("node-unreachable",), "node", target)


def _tor_uplink_down(lab: Lab, target: str, ctx: RunContext) -> Expectation:
    faults.tor_uplink_down(lab, target)
    return Expectation(("uplink-down",), "uplink", target, allow_ties=len(lab.tors) == 2)


def _link_flap(lab: Lab, target: str, ctx: RunContext) -> Expectation:
    flapper = faults.LinkFlapper(lab, target, period_s=2.0)
    flapper.start()
    ctx.cleanups.append(flapper.stop)
    return Expectation(("node-unreachable", "path-loss"), "node", target)


def _slow_link(lab: Lab, target: str, ctx: RunContext) -> Expectation:
    # A slow link shows in the ping-mesh once traffic queues on it, as training
    # traffic does: a bulk TCP stream from a peer keeps the token bucket full.
    faults.slow_link(lab, target, rate="20mbit", burst="64kb", latency="100ms")
    peer = next(n for n in lab.node_ids if n != target)
    dst = lab.node(target).fabric_ip
    sink = lab.exec(
        target, [sys.executable, "-c", _SINK], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(0.3)  # the sink binds its port; the source retries anyway
    source = lab.exec(
        peer,
        [sys.executable, "-c", _SOURCE, dst],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ctx.cleanups += [sink.kill, source.kill]
    return Expectation(("latency-degradation", "path-loss", "node-unreachable"), "node", target)


def _healthy(lab: Lab, target: str, ctx: RunContext) -> None:
    return None


def _emit_pfc(lab: Lab, target: str, ctx: RunContext, seconds: float) -> subprocess.Popen[bytes]:
    node = lab.node(target)
    argv = [
        sys.executable,
        "-m",
        "agents.pfc",
        node.fabric_if,
        "--priority",
        "3",
        "--rate",
        str(PFC_STORM_PPS),
        "--seconds",
        str(seconds),
    ]
    proc = lab.exec(target, argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctx.cleanups.append(proc.kill)
    return proc


LAB_JOB = "lab-job"
HANG_SEQ = 4242
# A real PyTorch ProcessGroupNCCL watchdog line (tests/fixtures/nccl, from
# XPixelGroup/BasicSR issue 737), with the rank and sequence number filled in.
_TIMEOUT_LINE = (
    "[rank{rank}]:[E626 06:24:44.173078629 ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog"
    " caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE,"
    " NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for 600061 milliseconds"
    " before timing out.\n"
)


def _nccl_logs(workdir: Path, node: str) -> Path:
    return workdir / "logs" / node


def _nccl_agent_flags(lab: Lab, node: str, workdir: Path) -> list[str]:
    folder = _nccl_logs(workdir, node)
    folder.mkdir(parents=True, exist_ok=True)
    return ["--nccl-log-glob", str(folder / "train*.log"), "--job-id", LAB_JOB]


def _nccl_hang(lab: Lab, target: str, ctx: RunContext) -> Expectation:
    """One job across every node, one rank per node; the target's rank stops short
    of collective HANG_SEQ and logs nothing, every other rank's watchdog times out
    waiting in it and logs the real PyTorch line."""
    ranks = [{"rank": i, "node": n, "gpu": 0} for i, n in enumerate(lab.node_ids)]
    r = httpx.post(
        f"{ctx.backend.url}/api/v1/jobs",
        json={"id": LAB_JOB, "name": "lab all-reduce", "ranks": ranks},
        headers={"Authorization": f"Bearer {ctx.backend.admin_token}"},
        timeout=10,
    )
    r.raise_for_status()
    for rank, node in enumerate(lab.node_ids):
        if node == target:
            continue
        log = _nccl_logs(ctx.workdir, node) / "train0.log"
        log.write_text(_TIMEOUT_LINE.format(rank=rank, seq=HANG_SEQ))
    return Expectation(("nccl-hang",), "node", target)


SLOW_RATE = "30mbit"
RING_BYTES = 4 << 20


def _slow_node(lab: Lab, target: str, ctx: RunContext) -> None:
    # The node's link is throttled: nothing is lost, probes still answer in
    # time, but its bandwidth is a fraction of its peers'. Only a benchmark
    # over it shows it, which is what the bisection runs.
    faults.slow_link(lab, target, rate=SLOW_RATE, burst="256kb", latency="50ms")
    return None


def _bisect_slow_node(
    run: LabRun, api: httpx.Client, ctx: RunContext, target: str, t0: float
) -> dict[str, Any]:
    created = api.post(
        "/api/v1/bisections",
        json={
            "nodes": ctx.lab.node_ids,
            "benchmark": "net-ring",
            # Lab nodes share the host's few cores, so healthy rings vary by a
            # factor of 3 when many run at once; the throttled link is 20-30x slower.
            "threshold": 0.8,
            "spec": {"nbytes": RING_BYTES},
            "deadline_s": 30,
        },
    )
    created.raise_for_status()
    bisection_id = created.json()["id"]
    deadline = time.time() + run.timeout_s
    view: dict[str, Any] = created.json()
    while time.time() < deadline and view["status"] == "running":
        time.sleep(0.25)
        view = api.get(f"/api/v1/bisections/{bisection_id}").json()
    verdict = view.get("verdict") or {}
    slow_nodes: dict[str, dict[str, Any]] = verdict.get("slow_nodes", {})
    slow = sorted(slow_nodes)
    return {
        "ok": slow == [target],
        "detected": [
            {
                "kind": "slow-node",
                "suspects": [
                    {"type": "node", "id": n, "score": round(1 - (e.get("ratio") or 0), 3)}
                    for n, e in slow_nodes.items()
                ],
            }
        ]
        if slow
        else [],
        "detected_after_s": round(time.time() - t0, 2) if slow else None,
        "bisection": bisection_id,
        "rounds": view["rounds_after_baseline"],
        "max_rounds": math.ceil(math.log2(len(ctx.lab.node_ids))),
        "verdict": verdict.get("outcome"),
        "reason": verdict.get("reason"),
    }


def _pfc_storm(lab: Lab, target: str, ctx: RunContext) -> Expectation:
    # The target's NIC pauses its switch port at storm rate, as a NIC with a
    # stuck receive path does; the pause frames are real 802.1Qbb frames.
    _emit_pfc(lab, target, ctx, seconds=120)
    return Expectation(("pfc-storm",), "node", target)


def _pfc_burst(lab: Lab, target: str, ctx: RunContext) -> None:
    # Half a second of pauses at storm rate: congestion control at work, not a storm.
    _emit_pfc(lab, target, ctx, seconds=0.5)
    return None


_SINK = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5201)); s.listen(4)
while True:
    c, _ = s.accept()
    while c.recv(1 << 16):
        pass
"""

_SOURCE = """
import socket, sys, time
buf = b"x" * (1 << 16)
while True:
    try:
        s = socket.create_connection((sys.argv[1], 5201), timeout=5)
        while True:
            s.sendall(buf)
    except OSError:
        time.sleep(0.2)
"""

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("node-down", "node", "the target node's fabric link goes down", _node_down),
        Scenario(
            "tor-uplink-down",
            "tor",
            "the target ToR's uplink to the spine goes down",
            _tor_uplink_down,
        ),
        Scenario("link-flap", "node", "the target node's link toggles every 2 s", _link_flap),
        Scenario(
            "slow-link", "node", "tc tbf at 20 Mbit/s on the target's link, under load", _slow_link
        ),
        Scenario(
            "slow-node",
            "node",
            f"tc tbf at {SLOW_RATE} on the target's link; a net-ring bisection must name it",
            _slow_node,
            detect=_bisect_slow_node,
            default_timeout_s=120.0,
        ),
        Scenario(
            "nccl-hang",
            "node",
            "a job over every node hangs an all-reduce: all ranks but the target's time out",
            _nccl_hang,
            agent_flags=_nccl_agent_flags,
            collectors="host,pingmesh,nccl",
        ),
        Scenario(
            "pfc-storm",
            "node",
            f"the target emits PFC pause frames at {PFC_STORM_PPS}/s on priority 3",
            _pfc_storm,
            collectors="host,pingmesh,pfc_sniffer",
        ),
        Scenario(
            "pfc-burst",
            "node",
            "a 0.5 s PFC burst from the target, shorter than the detection window: must detect"
            " nothing for --duration seconds",
            _pfc_burst,
            collectors="host,pingmesh,pfc_sniffer",
        ),
        Scenario(
            "healthy", "node", "no fault for --duration seconds: must detect nothing", _healthy
        ),
    )
}


def register_scenario(scenario: Scenario) -> None:
    """Other fault families (PFC, NCCL hangs, slow nodes) add their scenarios here."""
    SCENARIOS[scenario.name] = scenario


class LabRun:
    def __init__(
        self,
        nodes: int,
        tors: int,
        scenario: str,
        target: str | None,
        duration_s: float,
        timeout_s: float | None,
        database_url: str | None,
        log: Callable[[str], None],
    ) -> None:
        if scenario not in SCENARIOS:
            raise SystemExit(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
        if nodes < 2 or tors < 1 or tors > nodes:
            raise SystemExit("need at least 2 nodes and 1 <= tors <= nodes")
        self.nodes, self.tors = nodes, tors
        self.scenario = SCENARIOS[scenario]
        self.target = target
        self.duration_s = duration_s
        self.timeout_s = timeout_s or self.scenario.default_timeout_s
        self.database_url = database_url
        self.log = log

    def _choose_target(self, lab: Lab) -> str:
        choices = lab.tors if self.scenario.target_kind == "tor" else lab.node_ids
        if self.target is None:
            return random.choice(choices)
        if self.target not in choices:
            raise SystemExit(
                f"--target {self.target!r} is not a {self.scenario.target_kind} of"
                f" this lab: {', '.join(choices)}"
            )
        return self.target

    def run(self) -> dict[str, Any]:
        destroy_leftovers(LAB_PREFIX)
        with contextlib.ExitStack() as stack:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mw-lab-")))
            lab = stack.enter_context(Lab(self.nodes, self.tors, prefix=LAB_PREFIX))
            target = self._choose_target(lab)
            self.log(
                f"lab: {self.nodes} nodes on {self.tors} ToRs; scenario {self.scenario.name}"
                f", target {target}"
            )
            backend = BackendProcess(
                self.database_url,
                workdir / "backend",
                host=lab.backend_ip,
                extra_env={"MESHWATCH_ISOLATION_DRY_RUN": "false"},
            )
            backend.start()
            stack.callback(backend.stop)
            ctx = RunContext(lab, backend, workdir)
            stack.callback(lambda: [c() for c in reversed(ctx.cleanups)])
            agents = self._start_agents(lab, backend, workdir, target)
            stack.callback(lambda: _stop_all(agents))
            with httpx.Client(
                base_url=backend.url,
                timeout=10,
                headers={"Authorization": f"Bearer {backend.admin_token}"},
            ) as api:
                baseline_s = self._wait_baseline(api, lab, agents)
                self.log(
                    f"healthy baseline after {baseline_s:.1f} s; injecting {self.scenario.name}"
                )
                t0 = time.time()
                expect = self.scenario.inject(lab, target, ctx)
                if self.scenario.detect is not None:
                    result = self.scenario.detect(self, api, ctx, target, t0)
                else:
                    result = self._wait_detection(api, expect, t0)
                result.update(
                    scenario=self.scenario.name,
                    target=target,
                    nodes=self.nodes,
                    tors=self.tors,
                    baseline_s=round(baseline_s, 1),
                )
                incident_expected = expect is not None and self.scenario.detect is None
                result["isolated"] = self._isolated(api, incident_expected and result["ok"])
        return result

    def _start_agents(
        self, lab: Lab, backend: BackendProcess, workdir: Path, target: str
    ) -> list[subprocess.Popen[bytes]]:
        procs = []
        for node in lab.nodes:
            argv = agent_command(
                f"http://{lab.backend_ip}:{backend.port}",
                node.name,
                backend.bootstrap_token,
                workdir / "agents" / node.name,
                extra=[
                    "--rack",
                    node.tor,
                    "--address",
                    node.fabric_ip,
                    "--probe-bind-host",
                    node.fabric_ip,
                    "--collectors",
                    self.scenario.collectors,
                    "--pinglist-interval",
                    "2",
                    "--log-level",
                    "warning",
                    *self.scenario.agent_flags(lab, node.name, workdir),
                ],
            )
            log = open(workdir / f"agent-{node.name}.log", "wb")  # noqa: SIM115
            procs.append(lab.exec(node.name, argv, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        return procs

    def _wait_baseline(
        self,
        api: httpx.Client,
        lab: Lab,
        agents: list[subprocess.Popen[bytes]],
        timeout_s: float = 60.0,
    ) -> float:
        """Every agent reports fresh telemetry and the fabric is quiet for a few seconds."""
        start = time.monotonic()
        quiet_since: float | None = None
        while time.monotonic() - start < timeout_s:
            for p in agents:
                if p.poll() is not None:
                    raise RuntimeError(f"an agent exited with {p.returncode}")
            nodes = api.get("/api/v1/nodes").json()
            fresh = [
                n for n in nodes if n["telemetry_age_s"] is not None and n["telemetry_age_s"] < 3
            ]
            open_incidents = api.get("/api/v1/incidents", params={"state": "open"}).json()
            now = time.monotonic()
            if len(fresh) == len(lab.nodes) and not open_incidents:
                quiet_since = quiet_since or now
                # Pinglists refresh every 2 s and probes need a window to fill.
                if now - quiet_since >= 8.0:
                    return now - start
            else:
                quiet_since = None
            time.sleep(0.5)
        raise TimeoutError(f"no healthy baseline within {timeout_s:.0f} s")

    def _wait_detection(
        self, api: httpx.Client, expect: Expectation | None, t0: float
    ) -> dict[str, Any]:
        deadline = time.time() + (self.timeout_s if expect else self.duration_s)
        seen: list[dict[str, Any]] = []
        while time.time() < deadline:
            seen = api.get("/api/v1/incidents", params={"state": "open"}).json()
            if expect is not None:
                hits = [i for i in seen if expect.met_by(i)]
                if hits:
                    opened = datetime.fromisoformat(hits[0]["opened_at"]).timestamp()
                    return {
                        "ok": True,
                        "detected": [_brief(i) for i in seen],
                        "detected_after_s": round(max(0.0, opened - t0), 2),
                    }
            elif seen:
                break
            time.sleep(0.1)
        if expect is None:
            every = api.get("/api/v1/incidents").json()
            return {
                "ok": not every,
                "detected": [_brief(i) for i in every],
                "detected_after_s": None,
                "duration_s": self.duration_s,
            }
        return {"ok": False, "detected": [_brief(i) for i in seen], "detected_after_s": None}

    def _isolated(self, api: httpx.Client, wait: bool) -> list[str]:
        """Nodes the isolation policy took out of scheduling (waits briefly for it)."""
        deadline = time.time() + (5.0 if wait else 0.0)
        while True:
            nodes = api.get("/api/v1/nodes", params={"schedulable": "false"}).json()
            if nodes or time.time() >= deadline:
                return [n["id"] for n in nodes]
            time.sleep(0.2)


def _brief(incident: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": incident["kind"],
        "suspects": [
            {"type": s["type"], "id": s["id"], "score": s["score"]} for s in incident["suspects"]
        ],
    }


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_lab_run(args: Any) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    run = LabRun(
        args.nodes,
        args.tors,
        args.scenario,
        args.target,
        args.duration,
        args.timeout,
        args.database_url,
        log,
    )
    with _sigterm_as_interrupt():
        result = run.run()
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>18}: {v}")
    return 0 if result["ok"] else 1


def add_parser(sub: Any) -> None:
    lab = sub.add_parser("lab", help="network-namespace lab: real agents, real packets, faults")
    lsub = lab.add_subparsers(dest="lab", required=True)
    p = lsub.add_parser(
        "run",
        help="build a lab, inject a fault, report what was detected",
        description="Scenarios: " + "; ".join(f"{s.name}: {s.help}" for s in SCENARIOS.values()),
    )
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--tors", type=int, default=2)
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--target", help="node-NN or tor-N (default: chosen at random and printed)")
    p.add_argument(
        "--duration", type=float, default=30.0, help="seconds to watch in the healthy scenario"
    )
    p.add_argument("--timeout", type=float, help="seconds to wait for detection")
    p.add_argument(
        "--database-url", help="an empty database for the lab (default: a fresh embedded one)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_lab_run)
