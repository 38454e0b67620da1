"""The lab end to end: real namespaces, real agents, a real backend, real faults.

Each test runs what ``meshwatch lab run ... --json`` runs and checks the JSON
an operator reads: the right component named first, within seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from app.lab.runner import LAB_PREFIX, LabRun

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None, reason="the lab needs root and iproute2"
    ),
]


def run(fresh_db_url: str, **kw: object) -> dict:
    args = {
        "nodes": 8,
        "tors": 2,
        "target": None,
        "duration_s": 20.0,
        "timeout_s": 20.0,
        "database_url": fresh_db_url,
        "log": lambda m: None,
        **kw,
    }
    return LabRun(**args).run()  # type: ignore[arg-type]


def no_leftovers() -> None:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"{LAB_PREFIX}-" not in netns and f"{LAB_PREFIX}-" not in links


def test_node_down_names_the_node(fresh_db_url: str) -> None:
    result = run(fresh_db_url, scenario="node-down", target="node-05")
    assert result["ok"], result
    top = result["detected"][0]
    assert top["kind"] == "node-unreachable"
    assert top["suspects"][0] == {**top["suspects"][0], "type": "node", "id": "node-05"}
    assert result["detected_after_s"] <= 3.0
    no_leftovers()


def test_tor_uplink_down_names_the_uplink(fresh_db_url: str) -> None:
    result = run(fresh_db_url, nodes=9, tors=3, scenario="tor-uplink-down", target="tor-1")
    assert result["ok"], result
    kinds = [d["kind"] for d in result["detected"]]
    assert "uplink-down" in kinds
    top = result["detected"][kinds.index("uplink-down")]["suspects"][0]
    assert (top["type"], top["id"]) == ("uplink", "tor-1")
    no_leftovers()


def test_healthy_fabric_opens_nothing(fresh_db_url: str) -> None:
    result = run(fresh_db_url, scenario="healthy", duration_s=20.0)
    assert result["ok"], result
    assert result["detected"] == []
    no_leftovers()


def test_pfc_storm_names_the_source(fresh_db_url: str) -> None:
    result = run(fresh_db_url, scenario="pfc-storm", target="node-02")
    assert result["ok"], result
    storm = [d for d in result["detected"] if d["kind"] == "pfc-storm"]
    assert storm and storm[0]["suspects"][0]["id"] == "node-02"
    assert result["detected_after_s"] <= 2.0
    no_leftovers()


def test_pfc_burst_shorter_than_window_opens_nothing(fresh_db_url: str) -> None:
    result = run(fresh_db_url, scenario="pfc-burst", target="node-06", duration_s=10.0)
    assert result["ok"], result
    assert result["detected"] == []
    no_leftovers()


def test_nccl_hang_names_the_stalled_node(fresh_db_url: str) -> None:
    result = run(fresh_db_url, scenario="nccl-hang", target="node-04")
    assert result["ok"], result
    hang = [d for d in result["detected"] if d["kind"] == "nccl-hang"]
    assert hang and [s["id"] for s in hang[0]["suspects"]] == ["node-04"]
    no_leftovers()


def test_slow_node_found_by_bisection(fresh_db_url: str) -> None:
    result = run(fresh_db_url, scenario="slow-node", target="node-03", timeout_s=120.0)
    assert result["ok"], result
    assert [s["id"] for s in result["detected"][0]["suspects"]] == ["node-03"]
    assert result["rounds"] <= result["max_rounds"] == 3
    no_leftovers()
