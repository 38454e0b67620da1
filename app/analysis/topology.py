"""The shape of the data fabric: which ToR each node hangs off, and which pod each ToR is in.

The ping-mesh localizer explains failing pairs by the components their probes cross,
and the pinglist endpoint chooses whom each node probes; both need only this small
model. Components are typed ids so that every finding names exactly one thing:

- ``("node", "node-03")``: the node's NIC and the cable to its ToR
- ``("tor", "tor-1")``: the ToR switch itself
- ``("uplink", "tor-1")``: that ToR's uplinks to the spine, as one bundle
- ``("spine", "pod-0")``: the spine layer of one pod (``("spine", "core")`` with one core)
- ``("path", "node-01|node-05")``: one directed pair, e.g. a single bad ECMP path

Pure code: no database, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

Component = tuple[str, str]

CORE_SPINE = "core"


@dataclass(frozen=True)
class NodeInfo:
    """Where one node sits in the fabric and the address its peers probe."""

    tor: str
    pod: str = "pod-0"
    address: str = ""
    port: int = 7447


@dataclass
class Topology:
    """Nodes of the data fabric keyed by node id.

    ``spine="pod"`` models one spine layer per pod (cross-pod traffic crosses both
    pods' spines); ``spine="core"`` models a single spine/core shared by every ToR.
    Build it once per change of the node table; it caches derived lookups, so do
    not mutate ``nodes`` after first use.
    """

    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    spine: Literal["pod", "core"] = "pod"

    @classmethod
    def from_records(
        cls,
        records: Iterable[tuple[str, str, str | None, str, int]],
        spine: Literal["pod", "core"] = "pod",
    ) -> Topology:
        """Build from ``(node, tor, pod, address, port)`` rows, e.g. the nodes table."""
        nodes = {
            node: NodeInfo(tor=tor, pod=pod or "pod-0", address=address, port=port)
            for node, tor, pod, address, port in records
        }
        return cls(nodes=nodes, spine=spine)

    @classmethod
    def synthetic(
        cls,
        nodes: int,
        tors: int,
        pods: int = 1,
        spine: Literal["pod", "core"] = "pod",
    ) -> Topology:
        """A regular cluster: ``node-NNNN`` spread in order over ``tor-N``, ToRs over pods.

        Addresses come from 198.18.0.0/15, the range set aside for network benchmarks.
        """
        if nodes < 1 or tors < 1 or pods < 1:
            raise ValueError("nodes, tors and pods must be positive")
        per_tor = -(-nodes // tors)
        width = max(2, len(str(nodes - 1)))
        infos: dict[str, NodeInfo] = {}
        for i in range(nodes):
            tor_index = i // per_tor
            infos[f"node-{i:0{width}d}"] = NodeInfo(
                tor=f"tor-{tor_index}",
                pod=f"pod-{tor_index * pods // tors}",
                address=f"198.18.{i // 250}.{i % 250 + 1}",
            )
        return cls(nodes=infos, spine=spine)

    # -- lookups ---------------------------------------------------------------------------

    @cached_property
    def _by_tor(self) -> dict[str, list[str]]:
        by_tor: dict[str, list[str]] = {}
        for node in sorted(self.nodes):
            by_tor.setdefault(self.nodes[node].tor, []).append(node)
        return by_tor

    @cached_property
    def _tor_pod(self) -> dict[str, str]:
        return {info.tor: info.pod for info in self.nodes.values()}

    @property
    def tors(self) -> list[str]:
        """Every ToR, sorted."""
        return sorted(self._by_tor)

    def nodes_on(self, tor: str) -> list[str]:
        """The nodes under one ToR, sorted; empty for an unknown ToR."""
        return list(self._by_tor.get(tor, ()))

    def tor_of(self, node: str) -> str:
        return self.nodes[node].tor

    def pod_of(self, tor: str) -> str:
        return self._tor_pod[tor]

    def __contains__(self, node: object) -> bool:
        return node in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    # -- paths -----------------------------------------------------------------------------

    def fabric_between(self, tor_a: str, tor_b: str) -> tuple[Component, ...]:
        """The switch-side components from ToR ``tor_a`` to ToR ``tor_b`` (ends included)."""
        cache = self._fabric_cache
        key = (tor_a, tor_b)
        hit = cache.get(key)
        if hit is not None:
            return hit
        if tor_a == tor_b:
            comps: tuple[Component, ...] = (("tor", tor_a),)
        else:
            if self.spine == "core":
                spines: tuple[Component, ...] = (("spine", CORE_SPINE),)
            else:
                pod_a, pod_b = self.pod_of(tor_a), self.pod_of(tor_b)
                spines = (("spine", pod_a),) if pod_a == pod_b else (
                    ("spine", pod_a),
                    ("spine", pod_b),
                )
            comps = (("tor", tor_a), ("uplink", tor_a), *spines, ("uplink", tor_b), ("tor", tor_b))
        cache[key] = comps
        return comps

    @cached_property
    def _fabric_cache(self) -> dict[tuple[str, str], tuple[Component, ...]]:
        return {}

    def path(self, a: str, b: str) -> list[Component]:
        """Components a probe from ``a`` to ``b`` crosses, in order.

        Same ToR: ``[node a, tor, node b]``; different ToRs:
        ``[node a, tor a, uplink a, spine(s), uplink b, tor b, node b]``.
        """
        return [
            ("node", a),
            *self.fabric_between(self.nodes[a].tor, self.nodes[b].tor),
            ("node", b),
        ]


def pair_component(src: str, dst: str) -> Component:
    """The component that stands for one directed pair alone."""
    return ("path", f"{src}|{dst}")


# -- pinglists -------------------------------------------------------------------------------


def _stable_hash(*parts: str | int) -> int:
    # Python's hash() is salted per process; replicas must agree on every pinglist.
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")


def pinglist_for(
    topology: Topology, node: str, cross_tor_peers: int = 8, epoch: int = 0
) -> list[str]:
    """Whom ``node`` probes: every node on its own ToR, plus a bounded cross-ToR sample.

    The cross-ToR budget is dealt round-robin over the remote ToRs, so with
    ``cross_tor_peers >= len(remote ToRs)`` every remote ToR gets at least one peer
    (that is what lets the localizer tell an uplink from a node). The nodes of one ToR
    take consecutive, disjoint windows of each remote ToR's nodes, so the probes spread
    evenly and every node is probed from every ToR that has enough budget; the windows
    advance every ``epoch`` (e.g. the hour), so over successive epochs every cross-ToR
    pair gets probed. When the budget is smaller than the number of remote ToRs, the
    ToRs themselves rotate. Deterministic: every backend replica computes the same list.
    """
    if node not in topology.nodes:
        raise KeyError(node)
    own_tor = topology.tor_of(node)
    neighbours = topology.nodes_on(own_tor)
    position = neighbours.index(node)
    peers = [n for n in neighbours if n != node]

    remote = [t for t in topology.tors if t != own_tor]
    budget = max(0, cross_tor_peers)
    if not remote or budget == 0:
        return peers

    if budget < len(remote):
        # Too few slots for one peer per ToR: walk a slot sequence, so each remote ToR
        # comes round once every len(remote) slots and, each time it does, the next of
        # its nodes is probed. Nodes of one ToR start the walk at different places.
        start = _stable_hash(own_tor, "tors") + position * budget
        for slot in range(epoch * budget, epoch * budget + budget):
            tor = remote[(start + slot) % len(remote)]
            visit = (start + slot) // len(remote)
            members = topology.nodes_on(tor)
            peers.append(members[(_stable_hash(own_tor, tor) + position + visit) % len(members)])
        return peers

    # Every remote ToR gets `base` peers; the remainder goes to `extra` consecutive ToRs
    # starting at one that depends on the node's position, so the extra load spreads.
    base, extra = divmod(budget, len(remote))

    def share(pos: int, tor_index: int) -> int:
        return base + (1 if (tor_index - pos) % len(remote) < extra else 0)

    for tor_index, tor in enumerate(remote):
        members = topology.nodes_on(tor)
        take = min(share(position, tor_index), len(members))
        # The nodes of this ToR take consecutive, disjoint windows of the remote ToR's
        # nodes; all windows move on by `base` each epoch, which keeps them disjoint and
        # walks each node over every remote node within len(members) / base epochs.
        before = sum(share(pos, tor_index) for pos in range(position))
        offset = _stable_hash(own_tor, tor) + before + epoch * base
        peers.extend(members[(offset + i) % len(members)] for i in range(take))
    return peers


def pinglist_version(peers: Iterable[str]) -> str:
    """A stable short hash of a pinglist, for the ETag; order-sensitive as the list is.

    Pass ``f"{node}@{address}:{port}"`` strings when address changes must change the tag.
    """
    digest = hashlib.sha256("\n".join(peers).encode()).hexdigest()
    return digest[:16]
