"""Shipper, daemon and CLI against a real HTTP receiver on loopback.

The receiver speaks the backend's ingest protocol (register, ingest idempotent on
(node, seq), pinglist with ETag) and can be made to answer 503, to lose an
acknowledgement, or be stopped and restarted on the same port.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from agents.collectors.base import Roots, Samples
from agents.collectors.host import HostCollector
from agents.config import AgentConfig, ConfigError, load_config
from agents.daemon import AgentDaemon
from agents.protocol import Batch, Event, NicCounter, Peer, Pinglist, RegisterRequest
from agents.shipper import Shipper
from agents.spool import Spool

BOOTSTRAP = "bootstrap-secret"
REPO = Path(__file__).resolve().parents[2]
PROC_FIXTURE = REPO / "tests" / "fixtures" / "proc"


class Receiver:
    """A small real HTTP backend: register, idempotent ingest, pinglist."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tokens: dict[str, str] = {}  # token -> node
        self.stored: list[Batch] = []  # first arrival of each (node, seq), in arrival order
        self.keys: set[tuple[str, int]] = set()
        self.attempts: list[tuple[int | None, int]] = []  # (seq, status) of every ingest request
        self.gzipped: dict[int, bool] = {}  # seq -> whether its last request was gzip-encoded
        self.registrations: list[RegisterRequest] = []
        self.answer_status: int | None = None  # answer every ingest with this, when set
        self.lose_ack_once: set[int] = set()  # store these seqs, then answer 503 once
        self.reject_seqs: set[int] = set()
        self.pinglist = Pinglist(node="n", version="v1", peers=[])
        self.port = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server = None

    def revoke_tokens(self) -> None:
        with self.lock:
            self.tokens.clear()

    def stored_seqs(self, node: str) -> list[int]:
        with self.lock:
            return [b.seq for b in self.stored if b.node == node]

    def attempts_for(self, seq: int) -> int:
        with self.lock:
            return sum(1 for s, _ in self.attempts if s == seq)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            # HTTP/1.0: one request per connection, so a stopped receiver is really gone.
            protocol_version = "HTTP/1.0"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: Any = None, headers: dict[str, str] | None = None
                       ) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def _bearer(self) -> str:
                return self.headers.get("Authorization", "").removeprefix("Bearer ")

            def _body(self) -> bytes:
                data = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                return data

            def do_POST(self) -> None:
                if self.path == "/api/v1/nodes/register":
                    self._register()
                elif self.path == "/api/v1/ingest":
                    self._ingest()
                else:
                    self._reply(404, {"detail": "not found"})

            def do_GET(self) -> None:
                node = self.path.removeprefix("/api/v1/pinglist/")
                with receiver.lock:
                    owner = receiver.tokens.get(self._bearer())
                    pinglist = receiver.pinglist
                if owner is None:
                    return self._reply(401, {"detail": "unknown token"})
                if owner != node:
                    return self._reply(403, {"detail": "token of another node"})
                etag = f'"{pinglist.version}"'
                if self.headers.get("If-None-Match") == etag:
                    return self._reply(304)
                self._reply(200, pinglist.model_dump(mode="json"), {"ETag": etag})

            def _register(self) -> None:
                if self._bearer() != BOOTSTRAP:
                    return self._reply(401, {"detail": "bad bootstrap token"})
                try:
                    request = RegisterRequest.model_validate_json(self._body())
                except ValidationError as exc:
                    return self._reply(422, {"detail": str(exc)})
                token = secrets.token_hex(16)
                with receiver.lock:
                    # A new registration revokes the node's earlier token.
                    receiver.tokens = {
                        t: n for t, n in receiver.tokens.items() if n != request.node
                    }
                    receiver.tokens[token] = request.node
                    receiver.registrations.append(request)
                self._reply(200, {"node": request.node, "token": token})

            def _ingest(self) -> None:
                gzipped = self.headers.get("Content-Encoding") == "gzip"
                body = self._body()
                try:
                    seq: int | None = int(json.loads(body)["seq"])
                except (ValueError, KeyError, TypeError):
                    seq = None
                status = self._ingest_status(body, seq, gzipped)
                with receiver.lock:
                    receiver.attempts.append((seq, status[0]))
                self._reply(*status)

            def _ingest_status(self, body: bytes, seq: int | None, gzipped: bool
                               ) -> tuple[int, Any]:
                with receiver.lock:
                    if receiver.answer_status is not None:
                        return receiver.answer_status, {"detail": "unavailable"}
                    owner = receiver.tokens.get(self._bearer())
                if owner is None:
                    return 401, {"detail": "unknown token"}
                try:
                    batch = Batch.model_validate_json(body)
                except ValidationError as exc:
                    return 422, {"detail": str(exc)}
                if owner != batch.node:
                    return 403, {"detail": "token of another node"}
                if batch.seq in receiver.reject_seqs:
                    return 422, {"detail": "refused"}
                with receiver.lock:
                    receiver.gzipped[batch.seq] = gzipped
                    key = (batch.node, batch.seq)
                    duplicate = key in receiver.keys
                    if not duplicate:
                        receiver.keys.add(key)
                        receiver.stored.append(batch)
                    if batch.seq in receiver.lose_ack_once:
                        receiver.lose_ack_once.discard(batch.seq)
                        return 503, {"detail": "stored, but the answer is lost"}
                rows = len(batch.hosts) + len(batch.nics) + len(batch.events)
                return 200, {"node": batch.node, "seq": batch.seq, "duplicate": duplicate,
                             "rows": rows}

        return Handler


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rx = Receiver()
    rx.start()
    yield rx
    if rx._server is not None:
        rx.stop()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False) as http:
        yield http


async def wait_until(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)


def make_shipper(receiver: Receiver, client: httpx.AsyncClient, spool: Spool, node: str = "n1",
                 **kwargs: Any) -> Shipper:
    kwargs.setdefault("backoff_base", 0.01)
    kwargs.setdefault("backoff_cap", 0.1)
    kwargs.setdefault("bootstrap_token", BOOTSTRAP)
    return Shipper(receiver.url, node, spool, client, **kwargs)


def make_batch(spool: Spool, node: str = "n1", nics: int = 0) -> Batch:
    now = datetime.now(UTC)
    return Batch(
        node=node,
        seq=spool.allocate_seq(),
        sent_at=now,
        nics=[NicCounter(ts=now, iface=f"eth{i % 8}", counter="rx_bytes", value=i, rate=1.5)
              for i in range(nics)],
    )


async def submit_many(shipper: Shipper, spool: Spool, count: int) -> list[int]:
    seqs = []
    for _ in range(count):
        batch = make_batch(spool, shipper.node)
        await shipper.submit(batch)
        seqs.append(batch.seq)
    return seqs


async def stop_task(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# -- shipper ---------------------------------------------------------------------------------


async def test_receiver_stopped_then_back_every_batch_arrives_once_in_order(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    spool = Spool(tmp_path / "spool")
    shipper = make_shipper(receiver, client, spool)
    task = asyncio.create_task(shipper.run())
    try:
        await submit_many(shipper, spool, 5)
        await wait_until(lambda: len(receiver.stored_seqs("n1")) == 5)

        receiver.stop()  # connection refused from here on
        await submit_many(shipper, spool, 10)
        await wait_until(lambda: shipper.stats.failures >= 3)
        assert len(spool) == 10  # kept on disk while the backend is away

        receiver.start()  # same port
        await wait_until(lambda: len(receiver.stored_seqs("n1")) == 15)
        await wait_until(lambda: len(spool) == 0)
    finally:
        await stop_task(task)
    assert receiver.stored_seqs("n1") == list(range(15))
    assert not list((tmp_path / "spool").glob("0*.json"))


async def test_503_then_lost_acknowledgement_stores_nothing_twice(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    spool = Spool(tmp_path / "spool")
    shipper = make_shipper(receiver, client, spool)
    receiver.answer_status = 503
    receiver.lose_ack_once = {3}
    task = asyncio.create_task(shipper.run())
    try:
        await submit_many(shipper, spool, 6)
        await wait_until(lambda: shipper.stats.failures >= 3)
        assert receiver.stored == []
        receiver.answer_status = None
        await wait_until(lambda: len(spool) == 0)
    finally:
        await stop_task(task)
    assert receiver.stored_seqs("n1") == list(range(6))
    assert receiver.attempts_for(2) == 1
    assert receiver.attempts_for(3) == 2  # resent once after its acknowledgement was lost
    assert shipper.stats.duplicates == 1
    assert shipper.stats.delivered == 6


async def test_new_spool_object_replays_what_an_earlier_run_left(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    receiver.stop()
    spool = Spool(tmp_path / "spool")
    first = make_shipper(receiver, client, spool, token_path=tmp_path / "token.json")
    for _ in range(4):
        await first.submit(make_batch(spool))
    assert await first.flush() is False  # backend away: all four stay spooled

    # The agent restarts: a new Spool and Shipper on the same folder.
    receiver.start()
    spool_again = Spool(tmp_path / "spool")
    second = make_shipper(receiver, client, spool_again, token_path=tmp_path / "token.json")
    await second.submit(make_batch(spool_again))
    assert await second.flush() is True
    assert receiver.stored_seqs("n1") == [0, 1, 2, 3, 4]


async def test_backlog_is_sent_several_batches_per_cycle(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    spool = Spool(tmp_path / "spool")
    shipper = make_shipper(receiver, client, spool, batches_per_cycle=8)
    for _ in range(20):
        batch = make_batch(spool)
        spool.append(batch.seq, batch.model_dump_json().encode())
    backlog = list(range(20))
    assert await shipper.flush(max_batches=8) is False
    assert receiver.stored_seqs("n1") == backlog[:8]
    assert await shipper.flush() is True
    assert receiver.stored_seqs("n1") == backlog


async def test_401_registers_again_and_delivers(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    spool = Spool(tmp_path / "spool")
    token_path = tmp_path / "token.json"
    shipper = make_shipper(receiver, client, spool, token_path=token_path)
    await shipper.submit(make_batch(spool))
    assert await shipper.flush() is True
    first_token = json.loads(token_path.read_text())["token"]

    receiver.revoke_tokens()  # e.g. the backend lost its node table
    await shipper.submit(make_batch(spool))
    assert await shipper.flush() is True

    assert receiver.stored_seqs("n1") == [0, 1]
    assert len(receiver.registrations) == 2
    saved = json.loads(token_path.read_text())
    assert saved["node"] == "n1" and saved["token"] != first_token
    assert oct(token_path.stat().st_mode & 0o777) == "0o600"


async def test_token_of_another_node_registers_as_this_node(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    other = make_shipper(receiver, client, Spool(tmp_path / "other"), node="other")
    other_token = await other.register()

    spool = Spool(tmp_path / "spool")
    shipper = make_shipper(receiver, client, spool, token=other_token)
    await shipper.submit(make_batch(spool))
    assert await shipper.flush() is True
    assert receiver.stored_seqs("n1") == [0]
    assert [r.node for r in receiver.registrations] == ["other", "n1"]


async def test_wrong_bootstrap_token_keeps_batches(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    spool = Spool(tmp_path / "spool")
    shipper = make_shipper(receiver, client, spool, bootstrap_token="wrong")
    await shipper.submit(make_batch(spool))
    assert await shipper.flush() is False
    assert spool.pending() == [0] and spool.rejected() == []


async def test_malformed_batch_moves_to_rejected_and_is_not_retried(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    spool = Spool(tmp_path / "spool")
    shipper = make_shipper(receiver, client, spool)
    await shipper.submit(make_batch(spool))
    # A batch the backend's schema refuses: CPU over 100 %.
    bad = make_batch(spool).model_dump(mode="json")
    bad["hosts"] = [{"ts": bad["sent_at"], "cpu_pct": 150.0, "load1": 0.1,
                     "mem_total_bytes": 1, "mem_available_bytes": 1}]
    spool.append(bad["seq"], json.dumps(bad).encode())
    await shipper.submit(make_batch(spool))

    task = asyncio.create_task(shipper.run())
    try:
        await wait_until(lambda: len(spool) == 0)
        await shipper.submit(make_batch(spool))
        await wait_until(lambda: len(spool) == 0)
    finally:
        await stop_task(task)

    assert receiver.stored_seqs("n1") == [0, 2, 3]
    assert spool.rejected() == [1]
    assert receiver.attempts_for(1) == 1
    reason = (spool.rejected_dir / f"{1:020d}.reason.txt").read_text()
    assert reason.startswith("HTTP 422") and "cpu_pct" in reason
    assert shipper.stats.rejected == 1
    assert any(r.levelname == "ERROR" and "REJECTED" in r.getMessage() for r in caplog.records)


async def test_large_bodies_are_gzipped_small_ones_are_not(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    spool = Spool(tmp_path / "spool")
    shipper = make_shipper(receiver, client, spool)
    small, large = make_batch(spool, nics=1), make_batch(spool, nics=400)
    assert len(small.model_dump_json()) < 4096 < len(large.model_dump_json())
    await shipper.submit(small)
    await shipper.submit(large)
    assert await shipper.flush() is True
    assert receiver.gzipped == {small.seq: False, large.seq: True}
    assert receiver.stored[1] == large  # decompressed and parsed intact


async def test_pinglist_with_etag(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    shipper = make_shipper(receiver, client, Spool(tmp_path / "spool"))
    peers = [Peer(node="n2", address="198.18.0.2", port=7447)]
    receiver.pinglist = Pinglist(node="n1", version="v7", peers=peers)

    pinglist, etag = await shipper.fetch_pinglist()
    assert pinglist is not None and pinglist.peers == peers and etag == '"v7"'
    assert await shipper.fetch_pinglist(etag) == (None, etag)


# -- config ----------------------------------------------------------------------------------


def test_config_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    config_file = tmp_path / "agent.toml"
    config_file.write_text(
        'server = "http://from-file:8000"\nnode-id = "file-node"\nrack = "tor-file"\n'
        'flows = 2\ncollectors = ["host", "nic"]\n'
    )
    env = {"MESHWATCH_NODE_ID": "env-node", "MESHWATCH_RACK": "tor-env",
           "MESHWATCH_CONFIG": str(config_file)}
    config = load_config({"rack": "tor-flag", "dscp": 26}, env=env)
    assert config.server == "http://from-file:8000"
    assert config.node_id == "env-node"
    assert config.rack == "tor-flag"
    assert (config.flows, config.dscp, config.probe_port) == (2, 26, 7447)
    assert config.collectors == ["host", "nic"]

    with pytest.raises(ConfigError, match="collectors"):
        load_config({"collectors": "host,warp-drive"}, env={})
    with pytest.raises(ConfigError, match="node_id"):
        load_config({"node_id": "has space"}, env={})


# -- daemon ----------------------------------------------------------------------------------


def daemon_config(receiver: Receiver, tmp_path: Path, **overrides: Any) -> AgentConfig:
    values: dict[str, Any] = dict(
        server=receiver.url, node_id="node-e2e", address="127.0.0.1", collectors=["host"],
        state_dir=tmp_path / "state", bootstrap_token=BOOTSTRAP, final_flush_seconds=2.0,
    )
    values.update(overrides)
    return AgentConfig(**values).validate()


async def test_daemon_ships_host_samples_end_to_end(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    daemon = AgentDaemon(daemon_config(receiver, tmp_path), client=client)
    task = asyncio.create_task(daemon.run(install_signal_handlers=False))

    def with_hosts() -> list[Batch]:
        with receiver.lock:
            return [b for b in receiver.stored if b.hosts]

    try:
        await wait_until(lambda: len(with_hosts()) >= 2)
    finally:
        daemon.stop()
        assert await asyncio.wait_for(task, 10) == 0
    batches = with_hosts()
    assert all(b.node == "node-e2e" for b in batches)
    assert all(0 <= b.hosts[0].cpu_pct <= 100 for b in batches)
    assert receiver.registrations[0].address == "127.0.0.1"
    seqs = receiver.stored_seqs("node-e2e")
    assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))
    assert len(daemon.spool) == 0
    messages = [e.message for b in receiver.stored for e in b.events if e.kind == "agent"]
    assert messages[0] == "agent started" and messages[-1] == "agent stopping"


async def test_failing_collector_is_skipped_and_reported(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    proc = tmp_path / "proc"
    shutil.copytree(PROC_FIXTURE, proc)
    broken = HostCollector(Roots(proc=proc))
    (proc / "stat").write_text("garbage\n")  # collect() now raises ValueError every round
    good = HostCollector(Roots())
    config = daemon_config(receiver, tmp_path, collectors=["host"])
    daemon = AgentDaemon(config, collectors=[broken, good], client=client)
    task = asyncio.create_task(daemon.run(install_signal_handlers=False))

    def batches_with_hosts() -> int:
        with receiver.lock:
            return sum(1 for b in receiver.stored if b.hosts)

    try:
        await wait_until(lambda: batches_with_hosts() >= 2)
    finally:
        daemon.stop()
        assert await asyncio.wait_for(task, 10) == 0
    errors = [e for b in receiver.stored for e in b.events if e.kind == "collector_error"]
    assert len(errors) == 1  # reported once a minute, not every second
    assert errors[0].attrs == {"collector": "host"} and "ValueError" in errors[0].message


class GatedCollector(HostCollector):
    """A host collector whose collect() waits on a gate, counting overlapping calls."""

    interval = 0.02

    def __init__(self) -> None:
        super().__init__(Roots())
        self.gate = asyncio.Event()
        self.running = 0
        self.most_running = 0
        self.calls = 0

    async def collect(self) -> Any:
        self.calls += 1
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await self.gate.wait()
            return await super().collect()
        finally:
            self.running -= 1


async def test_slow_collector_is_not_run_twice_at_once(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    slow = GatedCollector()
    daemon = AgentDaemon(daemon_config(receiver, tmp_path, batch_interval=0.05),
                         collectors=[slow], client=client)
    task = asyncio.create_task(daemon.run(install_signal_handlers=False))
    try:
        # Many of its 20 ms ticks pass while the first call hangs.
        await wait_until(lambda: daemon.batches_built >= 4)
        assert slow.calls == 1
        slow.gate.set()
        await wait_until(lambda: slow.calls >= 3)
    finally:
        daemon.stop()
        assert await asyncio.wait_for(task, 10) == 0
    assert slow.most_running == 1


async def test_missing_collector_module_fails_alone(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    # "gpu" is registered; with its module absent (or its library missing), only it fails.
    config = daemon_config(receiver, tmp_path, collectors=["gpu", "host"])
    daemon = AgentDaemon(config, client=client)
    task = asyncio.create_task(daemon.run(install_signal_handlers=False))
    try:
        await wait_until(lambda: any(b.hosts for b in list(receiver.stored)))
    finally:
        daemon.stop()
        assert await asyncio.wait_for(task, 10) == 0
    assert [c.name for c in daemon.collectors][-1] == "host"


# -- CLI -------------------------------------------------------------------------------------


def _agent_process(receiver: Receiver, state_dir: Path, node: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MESHWATCH_BOOTSTRAP_TOKEN": BOOTSTRAP}
    env.pop("MESHWATCH_CONFIG", None)
    return subprocess.Popen(
        [sys.executable, "-m", "agents.cli", "run", "--server", receiver.url, "--node-id", node,
         "--address", "127.0.0.1", "--state-dir", str(state_dir), "--collectors", "host",
         "--final-flush-seconds", "2"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def _last_allocated_seq(state_dir: Path) -> int:
    return int(json.loads((state_dir / "spool" / "state.json").read_text())["next_seq"]) - 1


async def test_sigterm_delivers_final_batch_and_exits_0(
    receiver: Receiver, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    proc = _agent_process(receiver, state_dir, "node-sig")
    try:
        await wait_until(lambda: len(receiver.stored_seqs("node-sig")) >= 1, timeout=30)
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr.decode()
    last = _last_allocated_seq(state_dir)
    with receiver.lock:
        final = [b for b in receiver.stored if b.seq == last]
    assert final and any(e.message == "agent stopping" for e in final[0].events)
    assert not list((state_dir / "spool").glob("0*.json"))


async def test_sigterm_with_backend_away_keeps_final_batch_in_spool(
    receiver: Receiver, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    proc = _agent_process(receiver, state_dir, "node-away")
    try:
        await wait_until(lambda: len(receiver.stored_seqs("node-away")) >= 1, timeout=30)
        receiver.stop()
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr.decode()
    last = _last_allocated_seq(state_dir)
    spooled = Spool(state_dir / "spool").read(last)
    assert spooled is not None
    final = Batch.model_validate_json(spooled)
    assert any(e.message == "agent stopping" for e in final.events)


def test_run_help_documents_every_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agents.cli", "run", "--help"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    for flag in ("--server", "--node-id", "--rack", "--pod", "--address", "--probe-port",
                 "--probe-bind-host", "--flows", "--dscp", "--collectors", "--nccl-log-glob",
                 "--job-id", "--state-dir", "--spool-max-bytes", "--batch-interval",
                 "--bootstrap-token"):
        assert flag in result.stdout


def test_run_refuses_bad_config_with_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agents.cli", "run", "--server", "ftp://x", "--state-dir",
         str(tmp_path)],
        cwd=REPO, capture_output=True, text=True,
    )
    assert result.returncode == 2 and "server" in result.stderr


async def test_daemon_probes_the_peers_of_its_pinglist(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    from agents.probes.responder import UdpEchoResponder

    peer = UdpEchoResponder("127.0.0.1", 0)
    await peer.start()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))  # a free port for the daemon's own responder
        own_port = probe.getsockname()[1]
    receiver.pinglist = Pinglist(node="node-e2e", version="v1", peers=[
        Peer(node="node-e2e", address="127.0.0.1", port=own_port),  # itself: left out
        Peer(node="peer-1", address="127.0.0.1", port=peer.port),
    ])
    config = daemon_config(receiver, tmp_path, collectors=["pingmesh"], probe_port=own_port,
                           probe_bind_host="127.0.0.1", flows=2)
    daemon = AgentDaemon(config, client=client)
    task = asyncio.create_task(daemon.run(install_signal_handlers=False))

    def answered() -> list[Any]:
        with receiver.lock:
            return [p for b in receiver.stored for p in b.probes if p.received > 0]

    try:
        await wait_until(lambda: {p.flow for p in answered()} >= set(range(2)), timeout=30)
    finally:
        daemon.stop()
        assert await asyncio.wait_for(task, 10) == 0
        await peer.stop()
    assert {p.peer for b in receiver.stored for p in b.probes} == {"peer-1"}


# -- parse -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "fixture"),
    [("xid", "tests/fixtures/xid"), ("nccl", "tests/fixtures/nccl"),
     ("ethtool", "tests/fixtures/ethtool")],
)
def test_parse_prints_one_json_object_per_event(kind: str, fixture: str) -> None:
    from agents.parsers import parse_lines

    files = sorted(p for p in (REPO / fixture).iterdir() if p.name != "SOURCES.md")
    path = max(files, key=lambda p: p.stat().st_size)
    with path.open(encoding="utf-8", errors="replace") as handle:
        expected = list(parse_lines(kind, (line.rstrip("\r\n") for line in handle)))
    assert expected, f"{path} holds no {kind} event"

    from_file = subprocess.run(
        [sys.executable, "-m", "agents.cli", "parse", kind, str(path)],
        cwd=REPO, capture_output=True, check=True,
    ).stdout
    from_stdin = subprocess.run(
        [sys.executable, "-m", "agents.cli", "parse", kind, "-"],
        cwd=REPO, capture_output=True, check=True, input=path.read_bytes(),
    ).stdout
    assert from_file == from_stdin
    lines = from_file.decode().splitlines()
    assert [json.loads(line) for line in lines] == json.loads(json.dumps(expected, default=str))
    assert all(isinstance(json.loads(line), dict) for line in lines)


class OneXidCollector(HostCollector):
    """Real host samples, plus one critical Xid event when the test releases it."""

    interval = 0.05

    def __init__(self) -> None:
        super().__init__(Roots())
        self.fire = False
        self.rounds = 0

    async def collect(self) -> Samples:
        self.rounds += 1
        samples = await super().collect()
        if self.fire:
            self.fire = False
            samples.events.append(Event(ts=datetime.now(UTC), kind="xid", severity="critical",
                                        message="NVRM: Xid (PCI:0000:3b:00): 79"))
        return samples


async def test_grave_event_ships_before_the_batch_tick(
    receiver: Receiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    collector = OneXidCollector()
    daemon = AgentDaemon(daemon_config(receiver, tmp_path, batch_interval=30.0),
                         collectors=[collector], client=client)
    task = asyncio.create_task(daemon.run(install_signal_handlers=False))

    def xids() -> int:
        with receiver.lock:
            return sum(1 for b in receiver.stored for e in b.events if e.kind == "xid")

    try:
        # A few rounds with nothing urgent first.
        await wait_until(lambda: collector.rounds >= 5)
        assert daemon.batches_built == 0  # the 30 s tick is far away
        collector.fire = True
        started = time.monotonic()
        await wait_until(lambda: xids() == 1)
        # Shipped at once, 30 s before its batch tick.
        assert time.monotonic() - started < 5
    finally:
        daemon.stop()
        assert await asyncio.wait_for(task, 10) == 0
