"""The lab topology and its faults, on real namespaces, bridges and packets.

Needs root and iproute2. Every test uses its own prefix ("mwt" + random) and
management /24, so parallel runs never collide, and checks on the way out
that nothing of its prefix survives.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from app.lab import faults, topology
from app.lab.topology import Lab, LabError, destroy_leftovers

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2"),
]

PY = sys.executable
ECHO_PORT = 7007
TCP_PORT = 7008

# Answers every UDP datagram on ECHO_PORT, on all of the node's addresses.
UDP_ECHO = textwrap.dedent(
    f"""
    import socket
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", {ECHO_PORT}))
    print("ready", flush=True)
    while True:
        data, addr = s.recvfrom(2048)
        s.sendto(data, addr)
    """
)

# argv: timeout_s host:port...  Prints {"host:port": reached} once every target
# answered or the timeout passed; resends every 50 ms so a lost ARP does not count.
UDP_PROBE = textwrap.dedent(
    """
    import json, select, socket, sys, time
    timeout = float(sys.argv[1])
    targets = {}
    for arg in sys.argv[2:]:
        host, port = arg.rsplit(":", 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setblocking(False)
        targets[s] = (arg, (host, int(port)))
    reached = {arg: False for arg, _ in targets.values()}
    deadline = time.monotonic() + timeout
    pending = set(targets)
    while pending and time.monotonic() < deadline:
        for s in pending:
            try:
                s.sendto(b"probe", targets[s][1])
            except OSError:
                pass  # no route / unreachable: try again until the deadline
        ready, _, _ = select.select(list(pending), [], [], 0.05)
        for s in ready:
            try:
                s.recvfrom(2048)
            except OSError:
                continue
            reached[targets[s][0]] = True
            pending.discard(s)
    print(json.dumps(reached))
    """
)

# Receives one TCP stream and reports bytes and seconds from first byte to EOF.
TCP_SINK = textwrap.dedent(
    f"""
    import json, socket, time
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", {TCP_PORT}))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    total, first = 0, None
    while True:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        if first is None:
            first = time.monotonic()
        total += len(chunk)
    print(json.dumps({{"bytes": total, "seconds": time.monotonic() - first}}), flush=True)
    """
)

# argv: host seconds. Sends as fast as the path allows for that long, then closes.
TCP_SOURCE = textwrap.dedent(
    f"""
    import socket, sys, time
    s = socket.create_connection((sys.argv[1], {TCP_PORT}), timeout=30)
    block = b"x" * (1 << 16)
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        s.sendall(block)
    s.close()
    """
)


def _leftovers(prefix: str) -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in netns.splitlines() if line.strip()]
    names += [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
    return [name for name in names if name.startswith(prefix + "-")]


def _wait_for_line(proc: subprocess.Popen[str], expected: str, timeout_s: float = 10) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if ready:
            line = proc.stdout.readline()
            if line.strip() == expected:
                return
            if not line:
                break
    raise AssertionError(f"{proc.args} never printed {expected!r} (rc={proc.poll()})")


def _wait_until(condition: Callable[[], bool], timeout_s: float = 10, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def prefix() -> Iterator[str]:
    name = "mwt" + secrets.token_hex(2)
    yield name
    left = destroy_leftovers(name)
    assert not left, f"the test left these behind: {left}"


def _mgmt_subnet() -> str:
    return f"198.19.{secrets.randbelow(254) + 1}.0/24"


@pytest.fixture
def lab(prefix: str) -> Iterator[Lab]:
    with Lab(nodes=8, tors=2, prefix=prefix, mgmt_subnet=_mgmt_subnet()) as built:
        yield built


@pytest.fixture
def echoing_lab(lab: Lab) -> Lab:
    """The 8-node lab with a UDP echo responder in every node."""
    procs = [
        lab.exec(node_id, [PY, "-c", UDP_ECHO], stdout=subprocess.PIPE, text=True)
        for node_id in lab.node_ids
    ]
    for proc in procs:
        _wait_for_line(proc, "ready")
    return lab


def probe(lab: Lab, src: str, dst_ips: list[str], timeout_s: float = 5.0) -> dict[str, bool]:
    """Which of ``dst_ips`` answer a UDP echo from ``src`` within ``timeout_s``."""
    targets = [f"{ip}:{ECHO_PORT}" for ip in dst_ips]
    done = lab.run(src, [PY, "-c", UDP_PROBE, str(timeout_s), *targets], check=True)
    reached = json.loads(done.stdout)
    return {target.rsplit(":", 1)[0]: ok for target, ok in reached.items()}


def fabric_ips(lab: Lab, node_ids: list[str]) -> list[str]:
    return [lab.node(node_id).fabric_ip for node_id in node_ids]


# -- the topology -----------------------------------------------------------------------


def test_layout_is_racks_of_contiguous_nodes(lab: Lab) -> None:
    assert lab.node_ids == [f"node-{i:02d}" for i in range(8)]
    assert [n.name for n in lab.nodes_on("tor-0")] == ["node-00", "node-01", "node-02", "node-03"]
    assert [n.name for n in lab.nodes_on("tor-1")] == ["node-04", "node-05", "node-06", "node-07"]
    node = lab.node("node-05")
    assert node.netns == f"{lab.prefix}-node-05"
    assert node.fabric_ip == "198.18.0.15"
    addrs = json.loads(lab.run("node-05", ["ip", "-j", "addr", "show"]).stdout)
    have = {
        (a["ifname"], i["local"]) for a in addrs for i in a["addr_info"] if i["family"] == "inet"
    }
    assert (node.fabric_if, node.fabric_ip) in have
    assert (node.mgmt_if, node.mgmt_ip) in have
    assert ("lo", "127.0.0.1") in have
    # Nothing may be routed out of the lab: no default route in any namespace.
    for node_id in lab.node_ids:
        routes = lab.run(node_id, ["ip", "route", "show", "default"]).stdout
        assert routes.strip() == "", f"{node_id} has a default route: {routes}"
    assert lab.fabric_cmd(["route", "show", "default"]).strip() == ""
    # The switches live in the fabric namespace, not the root one.
    assert "tor-0" in lab.fabric_cmd(["-o", "link", "show", "type", "bridge"])
    assert "spine" in lab.fabric_cmd(["-o", "link", "show", "type", "bridge"])


def test_node_reaches_every_peer_over_the_fabric(echoing_lab: Lab) -> None:
    lab = echoing_lab
    peers = fabric_ips(lab, lab.node_ids[1:])
    assert probe(lab, "node-00", peers) == {ip: True for ip in peers}


def test_node_reaches_backend_over_management(lab: Lab) -> None:
    backend = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    backend.bind((lab.backend_ip, 0))  # root namespace, where the backend runs
    backend.settimeout(0.1)
    port = backend.getsockname()[1]
    seen_from: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, addr = backend.recvfrom(2048)
            except TimeoutError:
                continue
            seen_from.append(addr[0])
            backend.sendto(data, addr)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        targets = [f"{lab.backend_ip}:{port}"]
        done = lab.run("node-00", [PY, "-c", UDP_PROBE, "5", *targets], check=True)
        assert json.loads(done.stdout) == {targets[0]: True}
        # It came over the management network, from the node's management address.
        assert lab.node("node-00").mgmt_ip in seen_from
    finally:
        stop.set()
        server.join()
        backend.close()


def test_destroy_leaves_nothing(prefix: str) -> None:
    lab = Lab(nodes=4, tors=2, prefix=prefix, mgmt_subnet=_mgmt_subnet()).create()
    try:
        names = _leftovers(prefix)
        assert f"{prefix}-fabric" in names and f"{prefix}-mgmt" in names
        # A process still running in a node must not keep its namespace alive.
        sleeper = lab.exec("node-01", [PY, "-c", "import time; time.sleep(600)"])
    finally:
        lab.destroy()
    assert _leftovers(prefix) == []
    assert sleeper.poll() is not None
    lab.destroy()  # idempotent


def test_context_manager_destroys_on_error(prefix: str) -> None:
    with pytest.raises(ZeroDivisionError):
        with Lab(nodes=2, tors=1, prefix=prefix, mgmt_subnet=_mgmt_subnet()):
            assert _leftovers(prefix)
            1 / 0  # noqa: B018
    assert _leftovers(prefix) == []


@pytest.mark.parametrize("failure", [RuntimeError("boom"), KeyboardInterrupt()])
def test_partial_create_failure_cleans_up(
    prefix: str, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    built: list[str] = []
    real_build = Lab._build_switches

    def build_then_fail(self: Lab) -> None:
        real_build(self)  # namespaces, veths and bridges all exist now
        built.extend(_leftovers(prefix))
        raise failure

    monkeypatch.setattr(Lab, "_build_switches", build_then_fail)
    with pytest.raises(type(failure)):
        Lab(nodes=4, tors=2, prefix=prefix, mgmt_subnet=_mgmt_subnet()).create()
    assert f"{prefix}-node-03" in built and f"{prefix}-m03" in built
    assert _leftovers(prefix) == []


def test_failed_ip_batch_in_fabric_cleans_up(prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real refusal by the kernel half way: the root namespace part is built,
    # then the switch namespace rejects a bridge name longer than IFNAMSIZ.
    monkeypatch.setattr(topology, "SPINE", "spine-name-too-long")
    with pytest.raises(LabError, match="spine-name-too-long"):
        Lab(nodes=4, tors=2, prefix=prefix, mgmt_subnet=_mgmt_subnet()).create()
    assert _leftovers(prefix) == []


def test_failed_root_batch_removes_only_what_it_made(prefix: str) -> None:
    # The third node's mgmt veth clashes with a link that is not the lab's:
    # the build stops there, and teardown must not take the stranger with it.
    stranger = f"mwx{secrets.token_hex(2)}"
    subprocess.run(["ip", "link", "add", stranger, "type", "bridge"], check=True)
    try:
        lab = Lab(nodes=4, tors=2, prefix=prefix, mgmt_subnet=_mgmt_subnet())
        lab.nodes[2].mgmt_peer = stranger
        with pytest.raises(LabError, match="File exists"):
            lab.create()
        assert _leftovers(prefix) == []
        still_there = subprocess.run(["ip", "link", "show", stranger], capture_output=True)
        assert still_there.returncode == 0
    finally:
        subprocess.run(["ip", "link", "del", stranger], check=False)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_lab_cleans_up(prefix: str, signum: int) -> None:
    script = textwrap.dedent(
        f"""
        import time
        from app.lab.topology import Lab
        with Lab(nodes=4, tors=2, prefix={prefix!r}, mgmt_subnet={_mgmt_subnet()!r}):
            print("ready", flush=True)
            time.sleep(600)
        """
    )
    proc = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        _wait_for_line(proc, "ready", timeout_s=30)
        assert _leftovers(prefix)
        proc.send_signal(signum)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _leftovers(prefix) == []


def test_destroy_leftovers_after_crash(prefix: str) -> None:
    script = textwrap.dedent(
        f"""
        import os
        from app.lab.topology import Lab
        lab = Lab(nodes=4, tors=2, prefix={prefix!r}, mgmt_subnet={_mgmt_subnet()!r}).create()
        os._exit(0)  # dies without destroy(), as after SIGKILL
        """
    )
    subprocess.run([PY, "-c", script], check=True, timeout=60)
    assert f"{prefix}-node-00" in _leftovers(prefix)
    # A new lab with the same prefix refuses to build over the wreck...
    with pytest.raises(LabError, match="destroy_leftovers"):
        Lab(nodes=4, tors=2, prefix=prefix).create()
    removed = destroy_leftovers(prefix)
    assert f"{prefix}-fabric" in removed
    assert _leftovers(prefix) == []


# -- faults -----------------------------------------------------------------------------


def test_node_down_cuts_fabric_but_not_management(echoing_lab: Lab) -> None:
    lab = echoing_lab
    dead = lab.node("node-05")
    fault = faults.node_down(lab, "node-05")
    assert fault in lab.faults
    for src in ("node-00", "node-04"):  # another rack and its own rack
        assert probe(lab, src, [dead.fabric_ip], timeout_s=1.0) == {dead.fabric_ip: False}
    # The others still reach each other...
    others = fabric_ips(lab, ["node-01", "node-04", "node-06"])
    assert probe(lab, "node-00", others) == {ip: True for ip in others}
    # ...and the dead node still reaches the backend, whose mgmt bridge answers it.
    assert probe_mgmt(lab, "node-05")
    # Its own interface is untouched: admin up, only the carrier is gone.
    link = json.loads(lab.run("node-05", ["ip", "-j", "link", "show", dead.fabric_if]).stdout)[0]
    assert "UP" in link["flags"] and "NO-CARRIER" in link["flags"]

    faults.node_up(lab, "node-05")
    assert fault not in lab.faults
    assert probe(lab, "node-00", [dead.fabric_ip]) == {dead.fabric_ip: True}


def probe_mgmt(lab: Lab, node_id: str) -> bool:
    """Whether ``node_id`` reaches a UDP echo bound to the backend address over mgmt."""
    backend = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    backend.bind((lab.backend_ip, 0))
    backend.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, addr = backend.recvfrom(2048)
            except TimeoutError:
                continue
            backend.sendto(data, addr)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        target = f"{lab.backend_ip}:{backend.getsockname()[1]}"
        done = lab.run(node_id, [PY, "-c", UDP_PROBE, "5", target], check=True)
        return json.loads(done.stdout)[target]
    finally:
        stop.set()
        server.join()
        backend.close()


def test_tor_uplink_down_splits_racks(echoing_lab: Lab) -> None:
    lab = echoing_lab
    faults.tor_uplink_down(lab, "tor-1")
    rack1 = fabric_ips(lab, ["node-05", "node-06", "node-07"])
    assert probe(lab, "node-04", rack1) == {ip: True for ip in rack1}
    rack0 = fabric_ips(lab, ["node-01", "node-02", "node-03"])
    assert probe(lab, "node-00", rack0) == {ip: True for ip in rack0}
    cross = fabric_ips(lab, ["node-00", "node-03"])
    assert probe(lab, "node-04", cross, timeout_s=1.0) == {ip: False for ip in cross}
    cross = fabric_ips(lab, ["node-04", "node-07"])
    assert probe(lab, "node-01", cross, timeout_s=1.0) == {ip: False for ip in cross}

    faults.tor_uplink_up(lab, "tor-1")
    assert probe(lab, "node-01", cross) == {ip: True for ip in cross}


def test_tor_down_cuts_its_rack_and_undo_restores(echoing_lab: Lab) -> None:
    lab = echoing_lab
    faults.node_down(lab, "node-06")  # already down before the ToR dies
    fault = faults.tor_down(lab, "tor-1")
    rack1 = fabric_ips(lab, ["node-04", "node-05", "node-07"])
    assert probe(lab, "node-00", rack1, timeout_s=1.0) == {ip: False for ip in rack1}
    intra = fabric_ips(lab, ["node-05"])
    assert probe(lab, "node-04", intra, timeout_s=1.0) == {ip: False for ip in intra}
    fault.undo()
    assert probe(lab, "node-00", rack1) == {ip: True for ip in rack1}
    # The node that was down before stays down.
    node6 = lab.node("node-06").fabric_ip
    assert probe(lab, "node-00", [node6], timeout_s=1.0) == {node6: False}


def test_link_flapper_toggles_until_stopped(echoing_lab: Lab) -> None:
    lab = echoing_lab
    port = lab.node("node-03").switch_port

    def port_up() -> bool:
        return ",UP" in lab.fabric_cmd(["-o", "link", "show", "dev", port]).split(">")[0]

    flapper = faults.LinkFlapper(lab, "node-03", period_s=0.3)
    with flapper:
        _wait_until(lambda: flapper.toggles >= 4, timeout_s=10, what="four toggles")
        seen: set[bool] = set()

        def saw_both_states() -> bool:
            seen.add(port_up())
            return seen == {True, False}

        _wait_until(saw_both_states, timeout_s=10, what="the port both up and down")
    assert flapper.error is None
    assert port_up()
    assert flapper.toggles >= 4
    ip = lab.node("node-03").fabric_ip
    assert probe(lab, "node-00", [ip]) == {ip: True}


def measure_throughput(lab: Lab, src: str, dst: str, seconds: float = 1.0) -> float:
    """Bytes per second a TCP stream from ``src`` delivers to ``dst`` over the fabric."""
    sink = lab.exec(dst, [PY, "-c", TCP_SINK], stdout=subprocess.PIPE, text=True)
    _wait_for_line(sink, "ready")
    lab.run(src, [PY, "-c", TCP_SOURCE, lab.node(dst).fabric_ip, str(seconds)], check=True)
    out, _ = sink.communicate(timeout=60)
    result = json.loads(out.strip().splitlines()[-1])
    return result["bytes"] / result["seconds"]


def test_slow_link_throttles_only_that_node(lab: Lab) -> None:
    fault = faults.slow_link(lab, "node-02", rate="10mbit")
    node = lab.node("node-02")
    # Both ends of the cable carry the token bucket.
    assert "tbf" in lab.run("node-02", ["tc", "qdisc", "show", "dev", node.fabric_if]).stdout
    switch_side = subprocess.run(
        ["tc", "-n", lab.fabric_netns, "qdisc", "show", "dev", node.switch_port],
        capture_output=True,
        text=True,
    ).stdout
    assert "tbf" in switch_side

    healthy = measure_throughput(lab, "node-00", "node-01")
    slowed = measure_throughput(lab, "node-00", "node-02")
    slowed_out = measure_throughput(lab, "node-02", "node-01")
    assert slowed < healthy / 5, (healthy, slowed)
    assert slowed_out < healthy / 5, (healthy, slowed_out)

    faults.clear(lab, "node-02")
    assert fault not in lab.faults
    assert "tbf" not in lab.run("node-02", ["tc", "qdisc", "show", "dev", node.fabric_if]).stdout
    restored = measure_throughput(lab, "node-00", "node-02")
    assert restored > slowed * 5, (restored, slowed)


def test_destroy_undoes_active_faults(prefix: str) -> None:
    lab = Lab(nodes=4, tors=2, prefix=prefix, mgmt_subnet=_mgmt_subnet()).create()
    try:
        flapper = faults.LinkFlapper(lab, "node-01", period_s=0.2).start()
        faults.slow_link(lab, "node-02")
        faults.tor_uplink_down(lab, "tor-1")
        _wait_until(lambda: flapper.toggles >= 2, what="the flapper to run")
    finally:
        lab.destroy()
    assert lab.faults == []
    assert flapper._thread is not None and not flapper._thread.is_alive()
    assert _leftovers(prefix) == []
