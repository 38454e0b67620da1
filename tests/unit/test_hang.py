"""Hang localisation, pure logic: which node stopped the collective."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from agents.parsers.nccl import NcclLogParser
from app.analysis.hang import (
    CollectiveReport,
    NodeEvidence,
    Placement,
    assign_jobs,
    candidate_nodes,
    find_hangs,
    rank_suspects,
    to_report,
)

T0 = datetime(2026, 11, 23, 12, 0, 0, tzinfo=UTC)
NCCL_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nccl"


def placements(nodes: int = 4, per_node: int = 2) -> list[Placement]:
    """Ranks 0..n-1, ``per_node`` consecutive ranks on each of node-a, node-b, ..."""
    return [
        Placement(rank, f"node-{chr(ord('a') + rank // per_node)}", rank % per_node)
        for rank in range(nodes * per_node)
    ]


class Reports:
    """Builds the reports ranks send, in arrival order."""

    def __init__(self, job: str = "job-1", places: list[Placement] | None = None) -> None:
        self.job = job
        self.node_of = {p.rank: p.node for p in places or placements()}
        self.items: list[CollectiveReport] = []

    def timeout(self, rank: int, seq: int, at: float = 0.0, op: str = "ALLREDUCE",
                pg: str | None = None, job: str | None = "default") -> Reports:
        self.items.append(
            CollectiveReport(
                order=len(self.items) + 1,
                ts=T0 + timedelta(seconds=at),
                node=self.node_of[rank],
                job=self.job if job == "default" else job,
                rank=rank,
                kind="nccl_timeout",
                seq=seq,
                op=op,
                pg=pg,
                timeout_ms=600_000,
                reason="watchdog_timeout",
                message=f"[Rank {rank}] Watchdog caught collective operation timeout",
            )
        )
        return self


def only(hangs: list) -> object:  # type: ignore[type-arg]
    assert len(hangs) == 1, hangs
    return hangs[0]


def test_rank_behind_by_one_collective_names_its_node() -> None:
    places = placements()
    reps = Reports(places=places)
    reps.timeout(5, 880, at=0.0)  # rank 5 is stuck in 880: its watchdog fires first
    for rank in (0, 1, 2, 3, 4, 6, 7):
        reps.timeout(rank, 881, at=0.4)
    hang = only(find_hangs("job-1", places, reps.items))
    assert hang.waited_seq == 881 and hang.op == "ALLREDUCE"
    assert [(r.rank, r.reached, r.behind_by) for r in hang.behind] == [(5, 880, 1)]
    assert hang.silent == []
    assert candidate_nodes(hang) == ["node-c"]
    suspects = rank_suspects(hang, {})
    assert [s.node for s in suspects] == ["node-c"]
    assert suspects[0].ranks == [5]
    report = to_report(hang, suspects)
    assert report.primary_node == "node-c"
    assert report.key == "job-1:880"  # the first timeout to arrive keys the hang
    assert report.evidence["behind_ranks"] == [
        {"rank": 5, "node": "node-c", "gpu": 1, "reached_seq": 880, "behind_by": 1}
    ]
    assert "node-c" in report.summary and "seq 881" in report.summary


def test_key_is_stable_as_more_reports_arrive() -> None:
    places = placements()
    reps = Reports(places=places).timeout(0, 881).timeout(1, 881)
    first = only(find_hangs("job-1", places, reps.items))
    reps.timeout(5, 880, at=1.0)
    for rank in (2, 3, 4, 6, 7):
        reps.timeout(rank, 881, at=1.5)
    later = only(find_hangs("job-1", places, reps.items))
    assert first.key == later.key == "job-1:881"
    # Seen early, the ranks not yet heard from are silent; the laggard then takes the lead.
    assert {r.node for r in first.silent} == {"node-b", "node-c", "node-d"}
    assert rank_suspects(later, {})[0].node == "node-c"


def test_silent_node_is_named() -> None:
    places = placements()
    reps = Reports(places=places)
    for rank in (0, 1, 2, 3, 4, 5):  # node-d (ranks 6, 7) says nothing
        reps.timeout(rank, 1207, at=rank * 0.1)
    hang = only(find_hangs("job-1", places, reps.items))
    assert [(r.rank, r.node) for r in hang.silent] == [(6, "node-d"), (7, "node-d")]
    suspects = rank_suspects(hang, {})
    assert [s.node for s in suspects] == ["node-d"]
    assert suspects[0].ranks == [6, 7]


def test_all_ranks_at_same_seq_ping_loss_names_the_node() -> None:
    places = placements()
    reps = Reports(places=places)
    for rank in range(8):
        reps.timeout(rank, 42, at=rank * 0.05)
    hang = only(find_hangs("job-1", places, reps.items))
    assert hang.behind == [] and hang.silent == []
    # No rank stands out: every node of the job is looked at.
    assert candidate_nodes(hang) == ["node-a", "node-b", "node-c", "node-d"]
    assert rank_suspects(hang, {}) == []
    assert "nothing on any node points at one" in to_report(hang, []).summary
    evidence = {
        "node-a": NodeEvidence(probes_sent=480, probes_received=480),
        "node-b": NodeEvidence(probes_sent=480, probes_received=120),
        "node-c": NodeEvidence(probes_sent=480, probes_received=479),  # one lost probe is noise
    }
    suspects = rank_suspects(hang, evidence)
    assert [s.node for s in suspects] == ["node-b"]
    assert "360 of 480 probes" in suspects[0].reasons[0]


def test_two_jobs_hanging_at_once() -> None:
    places_a = placements(nodes=2)  # node-a, node-b
    places_b = [Placement(p.rank, p.node.replace("node-", "node-x"), p.gpu)
                for p in placements(nodes=2)]  # node-xa, node-xb
    reps_a = Reports("job-a", places_a)
    reps_b = Reports("job-b", places_b)
    reps_a.timeout(0, 10).timeout(1, 10).timeout(3, 10)  # rank 2 on node-b silent
    reps_b.timeout(0, 500).timeout(1, 500).timeout(2, 499).timeout(3, 500)  # rank 2, node-xb
    merged = reps_a.items + reps_b.items
    found = {}
    for job, places in (("job-a", places_a), ("job-b", places_b)):
        hang = only(find_hangs(job, places, [r for r in merged if r.job == job]))
        found[hang.key] = rank_suspects(hang, {})[0].node
    assert found == {"job-a:10": "node-b", "job-b:500": "node-xb"}


def test_corroboration_orders_two_silent_nodes() -> None:
    places = placements()
    reps = Reports(places=places)
    for rank in (0, 1, 2, 3):  # node-c and node-d both silent
        reps.timeout(rank, 7)
    hang = only(find_hangs("job-1", places, reps.items))
    evidence = {
        "node-d": NodeEvidence(xids=[{"xid": 79, "pci": "0000:3b:00", "message": "NVRM: Xid"}]),
    }
    suspects = rank_suspects(hang, evidence)
    assert [s.node for s in suspects] == ["node-d", "node-c"]
    assert suspects[0].score > suspects[1].score
    assert any("Xid 79" in r for r in suspects[0].reasons)
    lost = {"node-c": NodeEvidence(gpu_lost=[{"gpu": 1}], gpus_silent=[1])}
    assert rank_suspects(hang, lost)[0].node == "node-c"


def test_unregistered_job_uses_reporting_nodes_and_knows_no_silence() -> None:
    reps = Reports(places=placements())
    reps.timeout(0, 100).timeout(2, 100).timeout(4, 99)
    hang = only(find_hangs("job-1", [], reps.items))
    assert hang.registered is False
    assert hang.silent == []
    assert rank_suspects(hang, {})[0].node == "node-c"


def test_separate_hangs_get_separate_keys() -> None:
    places = placements(nodes=1)
    reps = Reports(places=places)
    reps.timeout(0, 50).timeout(1, 50)
    reps.timeout(0, 12, at=3600).timeout(1, 12, at=3600.5)  # the restarted job hung again
    hangs = find_hangs("job-1", places, reps.items)
    assert [h.key for h in hangs] == ["job-1:50", "job-1:12"]


def test_process_groups_are_not_compared() -> None:
    places = placements(nodes=2)
    reps = Reports(places=places)
    # Data-parallel group at seq 9000, tensor-parallel group at seq 40: different counters.
    reps.timeout(0, 9000, pg="0").timeout(1, 9000, pg="0").timeout(2, 9000, pg="0")
    reps.timeout(3, 40, pg="1")
    hang = only(find_hangs("job-1", places, reps.items))
    assert hang.behind == []


def test_reports_without_job_are_assigned_through_the_rank_map() -> None:
    places = placements(nodes=2)
    reps = Reports(places=places)
    reps.timeout(0, 5, job=None).timeout(1, 5, job=None)
    other = [Placement(0, "node-a", 0)]  # another job also has a rank 0 on node-a
    assigned = assign_jobs(reps.items, {"job-1": places})
    assert {r.job for r in assigned} == {"job-1"}
    ambiguous = assign_jobs(reps.items, {"job-1": places, "job-2": other})
    assert [r.job for r in ambiguous] == [None, "job-1"]


def test_real_watchdog_lines_become_reports() -> None:
    """The collector's parse of real PyTorch lines feeds the analysis unchanged."""
    parser = NcclLogParser()
    lines = (NCCL_FIXTURES / "pytorch_118369_deepspeed_broadcast.log").read_bytes().splitlines()
    reports = []
    for i, line in enumerate(lines):
        parsed = parser.parse_line(line)
        if parsed is None:
            continue
        attrs = {k: v for k, v in parsed.items() if k not in ("kind", "severity", "rank")}
        reports.append(CollectiveReport.from_event(
            i, T0, f"node-{parsed['rank'] // 2}", "ds", parsed["rank"], parsed["kind"], attrs,
            parsed["message"]))
    # Ranks 2, 3, 4 and 6 timed out in broadcast 880; in an 8-rank job 0, 1, 5 and 7 did not.
    places = [Placement(r, f"node-{r // 2}") for r in range(8)]
    hang = only(find_hangs("ds", places, reports))
    assert (hang.waited_seq, hang.op, hang.timeout_ms) == (880, "BROADCAST", 1_800_000)
    assert [r.rank for r in hang.silent] == [0, 1, 5, 7]
    suspects = rank_suspects(hang, {})
    # node-0 has both its ranks silent: it leads the ones with one silent rank each.
    assert suspects[0].node == "node-0" and suspects[0].ranks == [0, 1]
