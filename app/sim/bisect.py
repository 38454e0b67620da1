"""``meshwatch sim bisect``: the bisection of a simulated fleet.

Every node has a benchmark figure (healthy ones around 1.0 with noise, the
slow ones at ``--slowdown`` of that); the real bisection state machine runs
against it and the verdict, rounds and groups tested are printed. For
sizing rounds on a fleet you do not want to disturb, and for demos.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from typing import Any

from app.analysis.bisect import simulate


def simulate_fleet(
    nodes: int, slow: list[str], slowdown: float, noise: float, fail: list[str], seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    names = [f"node-{i:0{max(2, len(str(nodes - 1)))}d}" for i in range(nodes)]
    unknown = [n for n in slow + fail if n not in names]
    if unknown:
        raise SystemExit(f"not in the fleet: {', '.join(unknown)} (nodes are {names[0]}..)")
    fleet = {n: rng.uniform(1 - noise, 1 + noise) * (slowdown if n in slow else 1.0) for n in names}
    state = simulate(fleet, "gemm", threshold=1 - (1 + slowdown) / 2, fail_nodes=fail)
    verdict = state.to_json()["verdict"] or {}
    return {
        "nodes": nodes,
        "slow": slow,
        "found": sorted(verdict.get("slow_nodes", {})),
        "failed": sorted(verdict.get("failed_nodes", {})),
        "outcome": verdict.get("outcome"),
        "rounds_after_baseline": max(0, len(state.rounds) - 1),
        "bound_for_one": math.ceil(math.log2(nodes)),
        "groups_tested": sum(len(r.groups) for r in state.rounds),
    }


def cmd_sim_bisect(args: argparse.Namespace) -> int:
    split = lambda v: [x for x in (v or "").split(",") if x]  # noqa: E731
    result = simulate_fleet(
        args.nodes, split(args.slow), args.slowdown, args.noise, split(args.fail), args.seed
    )
    print(
        json.dumps(result) if args.json else "\n".join(f"{k:>22}: {v}" for k, v in result.items())
    )
    return 0 if sorted(result["found"]) == sorted(split(args.slow)) else 1


def add_parser(sub: Any) -> None:
    sim = sub.add_parser("sim", help="simulated clusters for demos and sizing")
    ssub = sim.add_subparsers(dest="sim", required=True)
    p = ssub.add_parser("bisect", help="bisect a simulated fleet with slow nodes")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--slow", default="", help="comma-separated slow nodes, e.g. node-03,node-11")
    p.add_argument("--fail", default="", help="comma-separated nodes that never answer")
    p.add_argument("--slowdown", type=float, default=0.7, help="a slow node's figure (x healthy)")
    p.add_argument("--noise", type=float, default=0.03, help="healthy figures vary by +/- this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_sim_bisect)
