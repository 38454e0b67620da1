"""``meshwatch sim bisect`` end to end through the CLI."""

from __future__ import annotations

import json

import pytest

from app.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(["sim", "bisect", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_two_slow_nodes_in_sixteen_are_both_found(capsys: pytest.CaptureFixture[str]) -> None:
    code, result = run(capsys, "--nodes", "16", "--slow", "node-03,node-11")
    assert code == 0
    assert result["found"] == ["node-03", "node-11"] and result["outcome"] == "slow"


def test_one_slow_node_within_log2_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    code, result = run(capsys, "--nodes", "1000", "--slow", "node-421")
    assert code == 0 and result["found"] == ["node-421"]
    assert result["rounds_after_baseline"] <= result["bound_for_one"] == 10


def test_silent_node_is_named_failed(capsys: pytest.CaptureFixture[str]) -> None:
    code, result = run(capsys, "--nodes", "16", "--fail", "node-07")
    assert code == 0 and result["failed"] == ["node-07"] and result["found"] == []
