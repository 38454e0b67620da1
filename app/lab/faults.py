"""Fault injection on the lab's data fabric; the management network is never touched.

Every fault acts where a real one happens: a dead NIC or cable is the node's
switch port going down in the fabric namespace (the node sees its carrier
drop, its own admin state untouched); a failed ToR uplink is the ToR end of
the uplink veth going down; a slow link is a token bucket (``tc ... tbf``)
on both ends of the node's cable. Each function returns a ``Fault`` that can
be undone, and records it in ``lab.faults``; ``Lab.destroy()`` undoes
everything anyway by removing the namespaces.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from app.lab.topology import IP, Lab, LabError, run_cmd

log = logging.getLogger(__name__)

TC = "tc"


@dataclass
class Fault:
    """One injected fault: what it did (the commands run) and how to take it back."""

    kind: str  # "node_down", "tor_uplink_down", "tor_down", "slow_link", "link_flap"
    target: str  # node id or ToR name
    commands: list[list[str]] = field(default_factory=list)
    _undo: Callable[[], None] | None = field(default=None, repr=False)
    undone: bool = False

    def undo(self) -> None:
        """Take the fault back; a second call does nothing."""
        if self.undone:
            return
        self.undone = True
        if self._undo is not None:
            self._undo()


def _record(lab: Lab, fault: Fault) -> Fault:
    lab.faults.append(fault)
    return fault


def _forget(lab: Lab, kind: str, target: str) -> None:
    for fault in lab.faults:
        if fault.kind == kind and fault.target == target:
            fault.undone = True
    lab.faults[:] = [f for f in lab.faults if not f.undone]


def _set_links(lab: Lab, names: list[str], state: str) -> list[list[str]]:
    """``ip link set NAME up|down`` for each name in the switch namespace, one batch."""
    commands = [[IP, "-n", lab.fabric_netns, "link", "set", "dev", name, state] for name in names]
    script = "".join(f"link set dev {name} {state}\n" for name in names)
    run_cmd([IP, "-n", lab.fabric_netns, "-batch", "-"], input_text=script)
    return commands


def _link_is_up(lab: Lab, name: str) -> bool:
    out = lab.fabric_cmd(["-o", "link", "show", "dev", name])
    flags = out.split("<", 1)[1].split(">", 1)[0].split(",") if "<" in out else []
    return "UP" in flags


def node_down(lab: Lab, node_id: str) -> Fault:
    """The node's cable dies: its ToR port goes down, its peers lose it on the fabric."""
    port = lab.node(node_id).switch_port
    commands = _set_links(lab, [port], "down")
    return _record(
        lab, Fault("node_down", node_id, commands, lambda: _set_links(lab, [port], "up"))
    )


def node_up(lab: Lab, node_id: str) -> None:
    """Bring the node's ToR port back up."""
    _set_links(lab, [lab.node(node_id).switch_port], "up")
    _forget(lab, "node_down", node_id)


def tor_uplink_down(lab: Lab, tor: str) -> Fault:
    """The ToR loses its spine uplink: its rack still talks inside, not across."""
    lab.nodes_on(tor)  # fails fast on an unknown ToR
    tor_end, _ = lab.uplink(tor)
    commands = _set_links(lab, [tor_end], "down")
    return _record(
        lab, Fault("tor_uplink_down", tor, commands, lambda: _set_links(lab, [tor_end], "up"))
    )


def tor_uplink_up(lab: Lab, tor: str) -> None:
    """Bring the ToR's spine uplink back up."""
    lab.nodes_on(tor)
    _set_links(lab, [lab.uplink(tor)[0]], "up")
    _forget(lab, "tor_uplink_down", tor)


def tor_down(lab: Lab, tor: str) -> Fault:
    """The whole ToR dies: every node port and its uplink go down.

    Undo brings up only the ports that were up before, so a node already
    down stays down.
    """
    ports = [node.switch_port for node in lab.nodes_on(tor)] + [lab.uplink(tor)[0]]
    were_up = [port for port in ports if _link_is_up(lab, port)]
    commands = _set_links(lab, ports, "down")
    return _record(lab, Fault("tor_down", tor, commands, lambda: _set_links(lab, were_up, "up")))


def tor_up(lab: Lab, tor: str) -> None:
    """Bring every port of the ToR and its uplink back up."""
    ports = [node.switch_port for node in lab.nodes_on(tor)] + [lab.uplink(tor)[0]]
    _set_links(lab, ports, "up")
    _forget(lab, "tor_down", tor)


def slow_link(
    lab: Lab,
    node_id: str,
    rate: str = "10mbit",
    burst: str = "32kb",
    latency: str = "50ms",
) -> Fault:
    """Throttle the node's cable to ``rate`` both ways with a tbf on each end.

    Egress of the node's NIC slows what it sends; egress of its ToR port
    slows what it receives. ``latency`` bounds the tbf queue, like a
    switch buffer.
    """
    node = lab.node(node_id)
    tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
    commands = [
        [TC, "-n", node.netns, "qdisc", "replace", "dev", node.fabric_if, *tbf],
        [TC, "-n", lab.fabric_netns, "qdisc", "replace", "dev", node.switch_port, *tbf],
    ]
    try:
        for argv in commands:
            run_cmd(argv)
    except LabError:
        _clear_qdiscs(lab, node_id)
        raise
    return _record(lab, Fault("slow_link", node_id, commands, lambda: _clear_qdiscs(lab, node_id)))


def _clear_qdiscs(lab: Lab, node_id: str) -> None:
    node = lab.node(node_id)
    # "No such file" when no root qdisc is set: nothing to clear, not an error.
    run_cmd([TC, "-n", node.netns, "qdisc", "del", "dev", node.fabric_if, "root"], check=False)
    run_cmd(
        [TC, "-n", lab.fabric_netns, "qdisc", "del", "dev", node.switch_port, "root"],
        check=False,
    )


class LinkFlapper:
    """Toggle a node's ToR port down and up every ``period_s`` until stopped.

    A thread, so it runs beside blocking or asyncio code alike. ``stop()``
    leaves the port up; ``Lab.destroy()`` stops it too.
    """

    def __init__(self, lab: Lab, node_id: str, period_s: float = 2.0) -> None:
        if period_s <= 0:
            raise ValueError("period_s must be positive")
        self.lab = lab
        self.node_id = node_id
        self.port = lab.node(node_id).switch_port
        self.period_s = period_s
        self.toggles = 0  # how many times the port changed state
        self.is_down = False
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fault: Fault | None = None

    def start(self) -> LinkFlapper:
        """Begin flapping at once: the port goes down now, up one period later, and so on."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._loop, name=f"flap-{self.node_id}", daemon=True)
        self._fault = _record(self.lab, Fault("link_flap", self.node_id, [], self.stop))
        self.lab.add_cleanup(self.stop)
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                state = "up" if self.is_down else "down"
                _set_links(self.lab, [self.port], state)
                self.is_down = not self.is_down
                self.toggles += 1
                if self._stop.wait(self.period_s):
                    break
        except BaseException as err:  # kept for the caller; a dead lab ends the thread
            self.error = err
            log.warning("link flapper for %s stopped: %s", self.node_id, err)

    def stop(self) -> None:
        """Stop toggling and leave the port up."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.lab.remove_cleanup(self.stop)
        if self.is_down:
            try:
                _set_links(self.lab, [self.port], "up")
            except LabError as err:  # the lab may be gone already
                log.debug("flapper could not restore %s: %s", self.port, err)
            self.is_down = False
        if self._fault is not None:
            self._fault.undone = True
            _forget(self.lab, "link_flap", self.node_id)

    def __enter__(self) -> LinkFlapper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def clear(lab: Lab, node_id: str) -> None:
    """Take back every fault on the node: stop flapping, lift the tbf, port up."""
    for fault in list(lab.faults):
        if fault.target == node_id:
            fault.undo()
    _clear_qdiscs(lab, node_id)
    _set_links(lab, [lab.node(node_id).switch_port], "up")
    lab.faults[:] = [f for f in lab.faults if f.target != node_id and not f.undone]
