"""Topology paths and pinglist generation."""

from __future__ import annotations

from collections import Counter

import pytest

from app.analysis.topology import Topology, pair_component, pinglist_for, pinglist_version


@pytest.fixture
def cluster() -> Topology:
    # 60 nodes, 10 on each of 6 ToRs, ToRs 0-2 in pod-0 and 3-5 in pod-1.
    return Topology.synthetic(nodes=60, tors=6, pods=2)


def remote_nodes(topology: Topology, node: str) -> set[str]:
    own = topology.tor_of(node)
    return {n for n in topology.nodes if topology.tor_of(n) != own}


def test_synthetic_layout_and_lookups(cluster):
    assert cluster.tors == [f"tor-{i}" for i in range(6)]
    assert cluster.nodes_on("tor-1") == [f"node-{i:02d}" for i in range(10, 20)]
    assert cluster.tor_of("node-25") == "tor-2"
    assert cluster.pod_of("tor-2") == "pod-0" and cluster.pod_of("tor-3") == "pod-1"
    assert cluster.nodes_on("tor-99") == []
    assert len({info.address for info in cluster.nodes.values()}) == 60


def test_paths_cross_the_components_in_order(cluster):
    assert cluster.path("node-00", "node-05") == [
        ("node", "node-00"),
        ("tor", "tor-0"),
        ("node", "node-05"),
    ]
    assert cluster.path("node-00", "node-15") == [
        ("node", "node-00"),
        ("tor", "tor-0"),
        ("uplink", "tor-0"),
        ("spine", "pod-0"),
        ("uplink", "tor-1"),
        ("tor", "tor-1"),
        ("node", "node-15"),
    ]
    # Across pods both pods' spines are crossed; with one core, the core only.
    assert ("spine", "pod-0") in cluster.path("node-00", "node-45")
    assert ("spine", "pod-1") in cluster.path("node-00", "node-45")
    core = Topology(nodes=cluster.nodes, spine="core")
    assert [c for c in core.path("node-00", "node-45") if c[0] == "spine"] == [("spine", "core")]
    assert pair_component("node-01", "node-05") == ("path", "node-01|node-05")


def test_from_records_builds_from_node_table_rows():
    topology = Topology.from_records(
        [
            ("gpu-a1", "rack-a", "pod-x", "198.18.0.10", 7447),
            ("gpu-a2", "rack-a", None, "198.18.0.11", 7448),
        ]
    )
    assert topology.nodes_on("rack-a") == ["gpu-a1", "gpu-a2"]
    assert topology.nodes["gpu-a2"].pod == "pod-0"
    assert topology.nodes["gpu-a2"].port == 7448


def test_intra_tor_full_mesh(cluster):
    for node in cluster.nodes:
        peers = pinglist_for(cluster, node, cross_tor_peers=8)
        own = set(cluster.nodes_on(cluster.tor_of(node))) - {node}
        assert own <= set(peers)
        assert node not in peers
        assert len(peers) == len(set(peers)), "no peer twice"


def test_cross_tor_sample_is_bounded_and_covers_every_remote_tor(cluster):
    for node in cluster.nodes:
        peers = pinglist_for(cluster, node, cross_tor_peers=8)
        own_tor = cluster.tor_of(node)
        cross = [p for p in peers if cluster.tor_of(p) != own_tor]
        assert len(cross) == 8
        assert {cluster.tor_of(p) for p in cross} == set(cluster.tors) - {own_tor}


def test_every_node_is_probed_from_every_other_tor(cluster):
    # With one peer per remote ToR, the 10 nodes of a ToR split each remote ToR's 10
    # nodes between them: a dead node is seen from every ToR, every epoch.
    probed_from: dict[str, set[str]] = {n: set() for n in cluster.nodes}
    for node in cluster.nodes:
        for peer in pinglist_for(cluster, node, cross_tor_peers=5):
            probed_from[peer].add(cluster.tor_of(node))
    for node, tors in probed_from.items():
        assert tors == set(cluster.tors), node


def test_probe_load_is_spread_evenly(cluster):
    # The nodes of one ToR share out each remote ToR's nodes between them: from any one
    # ToR, no remote node gets more than one probe over any other node of its ToR.
    from_tor: Counter[tuple[str, str]] = Counter()
    for node in cluster.nodes:
        for peer in pinglist_for(cluster, node, cross_tor_peers=8):
            from_tor[(cluster.tor_of(node), peer)] += 1
    for src_tor in cluster.tors:
        for dst_tor in set(cluster.tors) - {src_tor}:
            counts = [from_tor[(src_tor, n)] for n in cluster.nodes_on(dst_tor)]
            assert max(counts) - min(counts) <= 1, (src_tor, dst_tor, counts)


def test_sample_rotates_with_epoch_and_covers_all_pairs_over_time(cluster):
    node = "node-13"
    first = pinglist_for(cluster, node, cross_tor_peers=8, epoch=0)
    assert pinglist_for(cluster, node, cross_tor_peers=8, epoch=1) != first
    seen: set[str] = set()
    for epoch in range(10):
        seen.update(pinglist_for(cluster, node, cross_tor_peers=8, epoch=epoch))
    assert seen >= remote_nodes(cluster, node)


def test_budget_below_remote_tor_count_rotates_the_tors(cluster):
    node = "node-42"
    per_epoch = [pinglist_for(cluster, node, cross_tor_peers=2, epoch=e) for e in range(30)]
    own_tor = cluster.tor_of(node)
    for peers in per_epoch:
        assert len([p for p in peers if cluster.tor_of(p) != own_tor]) == 2
    seen = {p for peers in per_epoch for p in peers}
    assert seen >= remote_nodes(cluster, node)


def test_pinglist_is_deterministic(cluster):
    again = Topology.synthetic(nodes=60, tors=6, pods=2)
    for node in ("node-00", "node-31", "node-59"):
        assert pinglist_for(cluster, node, epoch=7) == pinglist_for(again, node, epoch=7)


def test_single_tor_cluster_and_unknown_node():
    topology = Topology.synthetic(nodes=4, tors=1)
    assert pinglist_for(topology, "node-00") == ["node-01", "node-02", "node-03"]
    with pytest.raises(KeyError):
        pinglist_for(topology, "node-99")


def test_version_is_stable_and_tracks_content(cluster):
    peers = pinglist_for(cluster, "node-07", epoch=3)
    version = pinglist_version(peers)
    assert version == pinglist_version(list(peers))
    assert version == pinglist_version(pinglist_for(cluster, "node-07", epoch=3))
    assert version != pinglist_version(pinglist_for(cluster, "node-07", epoch=4))
    assert version != pinglist_version(peers[:-1])
    # A fixed value: the tag must not change between processes or releases.
    assert pinglist_version(["node-01", "node-02"]) == "85ebc99b4511ff0c"
    assert len(version) == 16 and int(version, 16) >= 0
