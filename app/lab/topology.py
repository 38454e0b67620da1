"""The lab cluster: real network namespaces as nodes, Linux bridges as switches.

The lab is built as real clusters are, with two networks apart:

* the DATA FABRIC, which the ping-mesh probes cross and where faults are
  injected. Every ToR switch and the spine are Linux bridges living together
  in one "switch" namespace ``{prefix}-fabric``. Node ``i`` plugs its
  ``fab0`` interface into port ``sw-node-XX`` of its ToR; each ToR joins the
  spine through a veth pair ``up-tK`` (ToR end) / ``upsp-tK`` (spine end), the
  ToR uplink. ToR -> spine -> ToR is a tree, so one flat L2 subnet
  (198.18.0.0/16, node ``i`` at 198.18.0.(10+i)) needs no spanning tree.
  Nodes go to ToRs in contiguous blocks, like racks: with 8 nodes and 2 ToRs,
  node-00..node-03 sit on tor-0 and node-04..node-07 on tor-1.

* the MANAGEMENT network, agent to backend: a bridge ``{prefix}-mgmt`` in
  the root namespace holding the backend address (198.19.0.1), and one veth
  ``{prefix}-mXX`` / ``mgmt0`` per node (node ``i`` at 198.19.0.(10+i)). A
  fault on the fabric never touches it, so a node cut off from its peers
  still reports, and so do they.

No namespace gets a default route: nothing leaves the lab. Every object the
lab makes carries the prefix (namespaces, root-namespace links), so
``destroy_leftovers(prefix)`` can clean up after a run that was killed.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

log = logging.getLogger(__name__)

IP = "ip"
FABRIC_SUBNET = "198.18.0.0/16"
MGMT_SUBNET = "198.19.0.0/16"
HOST_OFFSET = 10  # node i gets the (10+i)-th address of each subnet; .1 is the backend
NODE_FABRIC_IF = "fab0"
NODE_MGMT_IF = "mgmt0"
SPINE = "spine"
IFNAMSIZ = 15  # longest interface name the kernel accepts
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]*$")


class LabError(RuntimeError):
    """An ip/tc command of the lab failed, or the lab cannot be built as asked."""


class LabBatchError(LabError):
    """``ip -batch`` stopped at ``failed_line`` (1-based); the lines before it took effect."""

    def __init__(self, message: str, failed_line: int) -> None:
        super().__init__(message)
        self.failed_line = failed_line


@dataclass
class LabNode:
    """One node of the lab: a network namespace plugged into a ToR and the mgmt bridge."""

    name: str  # node id the agent uses: "node-00"
    netns: str  # "{prefix}-node-00"
    fabric_if: str  # interface inside netns on the data fabric
    fabric_ip: str  # address on fabric_if, without prefix length
    mgmt_ip: str  # address on mgmt_if, without prefix length
    tor: str  # "tor-0"
    mgmt_if: str = NODE_MGMT_IF
    switch_port: str = ""  # the ToR port (in the fabric namespace) the node's cable ends in
    mgmt_peer: str = ""  # the root-namespace end of the node's mgmt veth


def _ip_batch(lines: Sequence[str], netns: str | None = None, force: bool = False) -> int | None:
    """Run ``lines`` through one ``ip -batch -``; return None, or the 1-based failed line.

    ``ip -batch`` stops at the first failing line and names it ("Command failed
    -:N"), which tells exactly which objects exist. With ``force`` it goes on
    past errors (used for teardown, where "already gone" is fine).
    """
    if not lines:
        return None
    argv = [IP]
    if netns:
        argv += ["-n", netns]
    if force:
        argv.append("-force")
    argv += ["-batch", "-"]
    proc = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    if force:
        log.debug("ip -force -batch in %s: %s", netns or "root", proc.stderr.strip())
        return len(lines)
    match = re.search(r"Command failed -:(\d+)", proc.stderr)
    failed = int(match.group(1)) if match else 1
    raise LabBatchError(
        f"ip -batch in {netns or 'root namespace'} failed at {lines[failed - 1]!r}: "
        f"{proc.stderr.strip()}",
        failed,
    )


def run_cmd(
    argv: Sequence[str], check: bool = True, input_text: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run one ip/tc command; raise LabError naming it when ``check`` and it fails."""
    proc = subprocess.run(list(argv), input=input_text, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc


def _list_netns() -> list[str]:
    out = run_cmd([IP, "netns", "list"], check=False).stdout
    # Lines look like "mw-node-00 (id: 3)" or just "mw-node-00".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _list_root_links() -> list[str]:
    out = run_cmd([IP, "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _ports_not_forwarding(argv: list[str], expected: set[str]) -> list[str]:
    """Names in ``expected`` that ``argv`` (an ``ip -d -j link show``) lists as not ready."""
    links = json.loads(run_cmd(argv).stdout or "[]")
    ready = {
        link["ifname"]
        for link in links
        if link.get("operstate") == "UP"
        and link.get("linkinfo", {}).get("info_slave_data", {}).get("state") == "forwarding"
    }
    return sorted(expected - ready)


def _netns_pids(netns: str) -> list[int]:
    out = run_cmd([IP, "netns", "pids", netns], check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _kill_netns_processes(namespaces: Sequence[str], grace_s: float = 2.0) -> None:
    """Stop every process still inside ``namespaces``.

    A namespace whose last process is still alive outlives ``ip netns del``
    together with its veths, whose root ends would then survive the lab.
    """
    pids = [pid for ns in namespaces for pid in _netns_pids(ns) if pid != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _pid_alive(pid)]
        if alive:
            time.sleep(0.02)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _pid_alive(pid: int) -> bool:
    try:
        # Reap it if it is our child; a zombie of ours would look alive forever.
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_links_gone(prefix: str, timeout_s: float = 5.0) -> list[str]:
    """Wait until the root namespace has no link named ``prefix-*``; return any left."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [name for name in _list_root_links() if name.startswith(prefix + "-")]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def destroy_leftovers(prefix: str) -> list[str]:
    """Remove every namespace and root-namespace link named ``{prefix}-*``.

    For a previous run that crashed or was killed before its ``destroy()``.
    Returns the names it removed.
    """
    mine = prefix + "-"
    namespaces = [ns for ns in _list_netns() if ns.startswith(mine)]
    links = [name for name in _list_root_links() if name.startswith(mine)]
    _kill_netns_processes(namespaces)
    _ip_batch([f"link del dev {name}" for name in links], force=True)
    _ip_batch([f"netns del {ns}" for ns in namespaces], force=True)
    _wait_links_gone(prefix)
    return namespaces + links


class Lab:
    """A cluster of ``nodes`` namespaces on ``tors`` ToR bridges under one spine.

    ``with Lab(8, 2) as lab:`` builds it and always tears it down; so does
    ``create()`` itself when it fails or is interrupted half way. ``destroy()``
    is idempotent and removes exactly what this lab made.
    """

    def __init__(
        self,
        nodes: int,
        tors: int,
        prefix: str = "mw",
        mgmt_subnet: str = MGMT_SUBNET,
        fabric_subnet: str = FABRIC_SUBNET,
    ) -> None:
        if nodes < 1 or tors < 1 or tors > nodes:
            raise ValueError(f"need 1 <= tors <= nodes, got nodes={nodes} tors={tors}")
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix must be lowercase letters/digits, got {prefix!r}")
        self.prefix = prefix
        self.node_count = nodes
        self.tor_count = tors
        self.fabric_netns = f"{prefix}-fabric"
        self.mgmt_bridge = f"{prefix}-mgmt"
        self.fabric_net = ipaddress.ip_network(fabric_subnet)
        self.mgmt_net = ipaddress.ip_network(mgmt_subnet)
        if not (
            self.fabric_net.subnet_of(ipaddress.ip_network("198.18.0.0/15"))
            and self.mgmt_net.subnet_of(ipaddress.ip_network("198.18.0.0/15"))
        ):
            raise ValueError("lab subnets must lie inside 198.18.0.0/15")
        for net in (self.fabric_net, self.mgmt_net):
            if HOST_OFFSET + nodes >= net.num_addresses - 1:
                raise ValueError(f"{net} is too small for {nodes} nodes")
        # The backend listens here, in the root namespace.
        self.backend_ip = str(self.mgmt_net.network_address + 1)

        width = max(2, len(str(nodes - 1)))
        if len(f"{prefix}-m") + width > IFNAMSIZ or len(self.mgmt_bridge) > IFNAMSIZ:
            raise ValueError(f"prefix {prefix!r} too long for interface names")
        self.tors = [f"tor-{t}" for t in range(tors)]
        # Contiguous blocks, like racks: the first ceil/floor share on tor-0, and so on.
        base, extra = divmod(nodes, tors)
        tor_of: list[str] = []
        for t in range(tors):
            tor_of += [self.tors[t]] * (base + (1 if t < extra else 0))
        self.nodes: list[LabNode] = []
        for i in range(nodes):
            node_id = f"node-{i:0{width}d}"
            self.nodes.append(
                LabNode(
                    name=node_id,
                    netns=f"{prefix}-{node_id}",
                    fabric_if=NODE_FABRIC_IF,
                    fabric_ip=str(self.fabric_net.network_address + HOST_OFFSET + i),
                    mgmt_ip=str(self.mgmt_net.network_address + HOST_OFFSET + i),
                    tor=tor_of[i],
                    switch_port=f"sw-{node_id}",
                    mgmt_peer=f"{prefix}-m{i:0{width}d}",
                )
            )
        self._by_id = {node.name: node for node in self.nodes}
        # What exists now, so destroy() removes exactly that, even after a half create().
        self._made_netns: list[str] = []
        self._made_root_links: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._cleanups: list[Callable[[], None]] = []
        self._lock = threading.RLock()
        self._atexit_registered = False
        self._old_sigterm: Any = None
        # Faults injected through app.lab.faults, oldest first; destroy() undoes them all.
        self.faults: list[Any] = []
        self.created = False

    # -- lookups ---------------------------------------------------------------------------

    def node(self, node_id: str) -> LabNode:
        """The node with id ``node_id`` ("node-05")."""
        try:
            return self._by_id[node_id]
        except KeyError:
            raise KeyError(f"no node {node_id!r} in this lab") from None

    @property
    def node_ids(self) -> list[str]:
        return [node.name for node in self.nodes]

    def nodes_on(self, tor: str) -> list[LabNode]:
        """The nodes plugged into ``tor``, in order."""
        if tor not in self.tors:
            raise KeyError(f"no ToR {tor!r} in this lab")
        return [node for node in self.nodes if node.tor == tor]

    @staticmethod
    def uplink(tor: str) -> tuple[str, str]:
        """(ToR end, spine end) of the veth joining ``tor`` to the spine."""
        index = tor.removeprefix("tor-")
        return f"up-t{index}", f"upsp-t{index}"

    @property
    def fabric_prefixlen(self) -> int:
        return self.fabric_net.prefixlen

    @property
    def mgmt_prefixlen(self) -> int:
        return self.mgmt_net.prefixlen

    # -- build -----------------------------------------------------------------------------

    def create(self) -> Lab:
        """Build every namespace, bridge and link; on any failure remove what was made."""
        if self.created:
            return self
        try:
            self._register_atexit()
            self._check_no_leftovers()
            self._create_namespaces_and_links()
            self._build_switches()
            self._configure_nodes()
            self._wait_ready()
        except BaseException:
            # KeyboardInterrupt included: a half-built lab must not outlive the failure.
            self.destroy()
            raise
        self.created = True
        return self

    def _register_atexit(self) -> None:
        if not self._atexit_registered:
            atexit.register(self.destroy)
            self._atexit_registered = True

    def _check_no_leftovers(self) -> None:
        mine = self.prefix + "-"
        taken = [ns for ns in _list_netns() if ns.startswith(mine)]
        taken += [name for name in _list_root_links() if name.startswith(mine)]
        if taken:
            raise LabError(
                f"objects named {mine}* already exist ({', '.join(sorted(taken)[:5])}...); "
                f"another lab uses prefix {self.prefix!r}, or call destroy_leftovers()"
            )

    def _run_tracked(self, lines: list[str], made: list[tuple[str, str]]) -> None:
        """Run ``lines`` in the root namespace; ``made[i]`` is what line i creates.

        ("netns"|"link", name); only lines before the failing one are recorded,
        except on an interrupt, when all of them are (teardown forgives "not found").
        """
        try:
            _ip_batch(lines)
        except LabBatchError as err:
            self._record(made[: err.failed_line - 1])
            raise
        except BaseException:
            self._record(made)
            raise
        self._record(made)

    def _record(self, made: list[tuple[str, str]]) -> None:
        with self._lock:
            for kind, name in made:
                target = self._made_netns if kind == "netns" else self._made_root_links
                if name and name not in target:
                    target.append(name)

    def _create_namespaces_and_links(self) -> None:
        lines: list[str] = []
        made: list[tuple[str, str]] = []

        def add(line: str, kind: str = "", name: str = "") -> None:
            lines.append(line)
            made.append((kind, name))

        add(f"netns add {self.fabric_netns}", "netns", self.fabric_netns)
        for node in self.nodes:
            add(f"netns add {node.netns}", "netns", node.netns)
        # Management bridge in the root namespace; STP off so ports forward at once.
        add(
            f"link add name {self.mgmt_bridge} type bridge stp_state 0 forward_delay 0",
            "link",
            self.mgmt_bridge,
        )
        add(f"addr add {self.backend_ip}/{self.mgmt_prefixlen} dev {self.mgmt_bridge}")
        add(f"link set dev {self.mgmt_bridge} up")
        for node in self.nodes:
            # Both ends are born in their namespaces: no name clash in the root one.
            add(
                f"link add name {node.fabric_if} netns {node.netns} type veth "
                f"peer name {node.switch_port} netns {self.fabric_netns}"
            )
            add(
                f"link add name {node.mgmt_peer} type veth peer name {node.mgmt_if} "
                f"netns {node.netns}",
                "link",
                node.mgmt_peer,
            )
            add(f"link set dev {node.mgmt_peer} master {self.mgmt_bridge}")
            add(f"link set dev {node.mgmt_peer} up")
        self._run_tracked(lines, made)

    def _build_switches(self) -> None:
        lines = ["link set dev lo up"]
        bridge_opts = "type bridge stp_state 0 forward_delay 0"
        lines.append(f"link add name {SPINE} {bridge_opts}")
        for tor in self.tors:
            tor_end, spine_end = self.uplink(tor)
            lines += [
                f"link add name {tor} {bridge_opts}",
                f"link add name {tor_end} type veth peer name {spine_end}",
                f"link set dev {tor_end} master {tor}",
                f"link set dev {spine_end} master {SPINE}",
                f"link set dev {tor_end} up",
                f"link set dev {spine_end} up",
                f"link set dev {tor} up",
            ]
        lines.append(f"link set dev {SPINE} up")
        for node in self.nodes:
            lines += [
                f"link set dev {node.switch_port} master {node.tor}",
                f"link set dev {node.switch_port} up",
            ]
        _ip_batch(lines, netns=self.fabric_netns)

    def _configure_nodes(self) -> None:
        # One `ip -n NS -batch` per node, all at once: addresses must be set inside
        # each namespace, and serial subprocesses would dominate the build time.
        procs = []
        for node in self.nodes:
            script = "\n".join(
                [
                    "link set dev lo up",
                    f"addr add {node.fabric_ip}/{self.fabric_prefixlen} dev {node.fabric_if}",
                    f"link set dev {node.fabric_if} up",
                    f"addr add {node.mgmt_ip}/{self.mgmt_prefixlen} dev {node.mgmt_if}",
                    f"link set dev {node.mgmt_if} up",
                ]
            )
            proc = subprocess.Popen(
                [IP, "-n", node.netns, "-batch", "-"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            procs.append((node, proc, script))
        errors = []
        for node, proc, script in procs:
            _, err = proc.communicate(script + "\n")
            if proc.returncode != 0:
                errors.append(f"{node.name}: {err.strip()}")
        if errors:
            raise LabError("configuring nodes failed: " + "; ".join(errors))

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        """Return once every switch port carries traffic, so a probe sent now arrives.

        Carrier changes reach bridges through the kernel's linkwatch, up to a
        second later than ``ip link set up`` returns.
        """
        expected_fabric = {node.switch_port for node in self.nodes}
        for tor in self.tors:
            expected_fabric.update(self.uplink(tor))
        expected_mgmt = {node.mgmt_peer for node in self.nodes}
        deadline = time.monotonic() + timeout_s
        while True:
            waiting = _ports_not_forwarding(
                [IP, "-n", self.fabric_netns, "-d", "-j", "link", "show"], expected_fabric
            ) + _ports_not_forwarding(
                [IP, "-d", "-j", "link", "show", "master", self.mgmt_bridge], expected_mgmt
            )
            if not waiting:
                # Agents read their NIC's operstate; it must say UP before they start.
                waiting = self._node_links_not_up()
            if not waiting:
                return
            if time.monotonic() >= deadline:
                raise LabError(f"ports still not forwarding after {timeout_s}s: {waiting[:5]}")
            time.sleep(0.02)

    def _node_links_not_up(self) -> list[str]:
        procs = [
            (
                node,
                subprocess.Popen(
                    [IP, "-n", node.netns, "-j", "link", "show"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                ),
            )
            for node in self.nodes
        ]
        waiting = []
        for node, proc in procs:
            out, _ = proc.communicate()
            states = {link["ifname"]: link.get("operstate") for link in json.loads(out or "[]")}
            for ifname in (node.fabric_if, node.mgmt_if):
                if states.get(ifname) != "UP":
                    waiting.append(f"{node.netns}/{ifname}")
        return waiting

    # -- teardown --------------------------------------------------------------------------

    def add_cleanup(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` first thing in ``destroy()`` (fault injectors stop their threads)."""
        with self._lock:
            self._cleanups.append(fn)

    def remove_cleanup(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._cleanups:
                self._cleanups.remove(fn)

    def destroy(self) -> None:
        """Remove everything this lab made: processes, links, namespaces. Idempotent."""
        with self._lock, _sigint_deferred():
            cleanups, self._cleanups = self._cleanups, []
            for fn in reversed(cleanups):
                try:
                    fn()
                except Exception:  # one broken cleanup must not leave namespaces behind
                    log.exception("lab cleanup %r failed", fn)
            self.faults.clear()
            for proc in self._procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in self._procs:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    log.warning("process %d in the lab did not exit", proc.pid)
            self._procs.clear()
            _kill_netns_processes(self._made_netns)
            # Root links first: a namespace dies lazily, its veths' root ends with it.
            _ip_batch([f"link del dev {name}" for name in self._made_root_links], force=True)
            _ip_batch([f"netns del {ns}" for ns in self._made_netns], force=True)
            if self._made_root_links:
                left = _wait_links_gone(self.prefix)
                if left:
                    log.warning("links left after destroy: %s", left)
            self._made_root_links.clear()
            self._made_netns.clear()
            self.created = False
            if self._atexit_registered:
                atexit.unregister(self.destroy)
                self._atexit_registered = False

    def __enter__(self) -> Lab:
        # SIGTERM would end the process without unwinding the `with`; make it unwind.
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                self._old_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        try:
            return self.create()
        except BaseException:
            self._restore_sigterm()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.destroy()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # -- running things in nodes -----------------------------------------------------------

    def _netns_argv(self, node_id: str, argv: Sequence[str]) -> list[str]:
        return [IP, "netns", "exec", self.node(node_id).netns, *argv]

    def exec(self, node_id: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``node_id``'s namespace; ``destroy()`` kills it."""
        proc: subprocess.Popen[Any] = subprocess.Popen(
            self._netns_argv(node_id, argv), **popen_kwargs
        )
        with self._lock:
            self._procs.append(proc)
        return proc

    def run(
        self, node_id: str, argv: Sequence[str], timeout: float | None = 60, **run_kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``node_id``'s namespace to completion, output captured as text."""
        run_kwargs.setdefault("capture_output", True)
        run_kwargs.setdefault("text", True)
        return subprocess.run(self._netns_argv(node_id, argv), timeout=timeout, **run_kwargs)

    def fabric_cmd(self, argv: Sequence[str], check: bool = True) -> str:
        """Run ``ip ARGV`` in the switch namespace; return its stdout."""
        return run_cmd([IP, "-n", self.fabric_netns, *argv], check=check).stdout


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


class _sigint_deferred:
    """Hold Ctrl-C off while tearing down, so a second one cannot leave half a lab."""

    def __enter__(self) -> None:
        self._old: Any = None
        self._pending = False
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._pending = True

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            if self._pending and callable(self._old):
                self._old(signal.SIGINT, None)
