"""Passive straggler detection from per-rank step times.

In a synchronous job every rank waits for the slowest one at each collective,
so the job runs at the pace of its worst node. Each rank reports, per step,
the time it spent on its own work before entering the step's collective
(its compute time: the wall time of a whole step is the same on every rank
and shows nothing). For every step the detector compares the ranks with
robust statistics, immune to the straggler it is looking for:

* the median and the MAD (median absolute deviation) over the job's ranks;
* the modified z-score of Iglewicz and Hoaglin, ``0.6745 * (x - median) / MAD``,
  slow above ``z_threshold`` (3.5, their recommendation);
* and a minimum relative slowdown (5 %): a uniform fleet has a tiny MAD, so
  a rank 0.5 % slower gets a large z that means nothing.

One slow step is not an incident (a checkpoint, a GC pause, a data-loader
hiccup): a rank is reported only when it was slow in at least
``persist_fraction`` of its last ``window_steps`` steps and has been slow for
at least ``min_duration_s``. Findings are per node (its slow ranks grouped),
with corroboration hints: the node's GPUs report a throttle reason that slows
the clocks (HW slowdown, thermal, power brake), its SM clock sits below the
fleet's, or its ping-mesh RTT is high.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# NVML clock throttle reasons (nvmlClocksEventReasons / nvmlClocksThrottleReasons).
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
THROTTLE_HW_POWER_BRAKE = 0x80
THROTTLE_NAMES = {
    THROTTLE_SW_POWER_CAP: "sw_power_cap",
    THROTTLE_HW_SLOWDOWN: "hw_slowdown",
    THROTTLE_SW_THERMAL: "sw_thermal",
    THROTTLE_HW_THERMAL: "hw_thermal",
    THROTTLE_HW_POWER_BRAKE: "hw_power_brake",
}
# Power capping is routine on a busy GPU and is seen on healthy nodes too, so
# it is named in the evidence but does not corroborate on its own.
CORROBORATING_THROTTLE = (
    THROTTLE_HW_SLOWDOWN | THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL | THROTTLE_HW_POWER_BRAKE
)

MAD_TO_Z = 0.6745  # makes the MAD comparable to a standard deviation for normal data
Z_CAP = 1e6  # z when MAD is 0 and the rank is slower: finite so findings stay JSON


@dataclass(frozen=True)
class StragglerConfig:
    """Thresholds of the straggler detector."""

    z_threshold: float = 3.5
    min_slowdown: float = 0.05  # a rank must also be this fraction slower than the median
    window_steps: int = 20  # K: the last K evaluated steps of a job are judged
    persist_fraction: float = 0.8  # slow in at least this share of the rank's steps in K
    min_steps: int = 10  # a rank needs this many evaluated steps before it is judged
    min_duration_s: float = 30.0  # and must have been slow this long
    min_ranks: int = 4  # a step with fewer reporting ranks has no meaningful median
    stale_after_s: float = 300.0  # a job silent this long is forgotten
    hint_window_s: float = 120.0  # GPU and RTT samples this recent corroborate
    clock_drop: float = 0.10  # SM clock this far below the fleet median is a hint
    rtt_factor: float = 2.0  # node RTT this many times the fleet median is a hint


@dataclass(frozen=True)
class StragglerFinding:
    """A node whose ranks of one job are persistently slower than their peers."""

    job: str
    node: str
    ranks: list[int]
    slowdown: float  # median fraction slower than the step median, 0.3 = 30 %
    z: float  # median modified z-score over the slow steps
    evidence: dict[str, Any]
    # ts of the earliest slow step in the window when the episode was first
    # noticed; kept while the rank stays slow in at least half its steps.
    first_seen: float

    @property
    def corroborated(self) -> bool:
        return bool(self.evidence.get("hints"))


_GpuSample = tuple[float, int, float | None, int]


@dataclass
class _StepSample:
    node: str
    duration_s: float
    ts: float


@dataclass
class _Job:
    steps: dict[int, dict[int, _StepSample]] = field(default_factory=dict)
    last_ts: float = 0.0
    episode_start: dict[int, float] = field(default_factory=dict)  # rank -> first slow ts


class StragglerDetector:
    """Collects step times, GPU clocks and RTTs, and reports persistent stragglers."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self._jobs: dict[str, _Job] = {}
        # node -> recent (ts, gpu, sm_clock_mhz, throttle_reasons) and (ts, rtt_us)
        self._gpu: dict[str, deque[_GpuSample]] = {}
        self._rtt: dict[str, deque[tuple[float, float]]] = {}

    # -- input ---------------------------------------------------------------

    def observe_step(
        self, job: str, rank: int, node: str, step: int, duration_s: float, ts: float
    ) -> None:
        """One rank's compute time of one step (seconds), reported at ``ts`` (epoch s)."""
        if not math.isfinite(duration_s) or duration_s < 0:
            return  # garbage from a broken reporter is not evidence
        state = self._jobs.setdefault(job, _Job())
        state.steps.setdefault(step, {})[rank] = _StepSample(node, float(duration_s), float(ts))
        state.last_ts = max(state.last_ts, float(ts))
        # Keep a margin over K so late ranks of older steps still land.
        keep = 2 * self.config.window_steps + 2
        if len(state.steps) > keep:
            for old in sorted(state.steps)[: len(state.steps) - keep]:
                del state.steps[old]

    def observe_gpu(
        self,
        node: str,
        ts: float,
        sm_clock_mhz: float | None,
        throttle_reasons: int | None,
        gpu: int = 0,
    ) -> None:
        """One sample of one GPU of ``node``; call it for every GPU of the node."""
        samples = self._gpu.setdefault(node, deque(maxlen=4096))
        samples.append((float(ts), gpu, sm_clock_mhz, int(throttle_reasons or 0)))

    def observe_rtt(self, node: str, ts: float, rtt_us: float) -> None:
        """A ping-mesh RTT towards ``node`` (e.g. its p50 from one peer over one second)."""
        if math.isfinite(rtt_us) and rtt_us >= 0:
            self._rtt.setdefault(node, deque(maxlen=4096)).append((float(ts), float(rtt_us)))

    # -- evaluation ----------------------------------------------------------

    def evaluate(self, now: float) -> list[StragglerFinding]:
        """Findings for every job, judged on the steps seen so far."""
        cfg = self.config
        self._expire(now)
        findings: list[StragglerFinding] = []
        for job_name, job in sorted(self._jobs.items()):
            steps = self._complete_steps(job)[-cfg.window_steps :]
            per_rank: dict[int, list[tuple[bool, float, float, float]]] = {}
            rank_node: dict[int, str] = {}
            medians: list[float] = []
            for step in steps:
                samples = job.steps[step]
                durations = [s.duration_s for s in samples.values()]
                med = statistics.median(durations)
                mad = statistics.median(abs(d - med) for d in durations)
                medians.append(med)
                for rank, s in samples.items():
                    rank_node[rank] = s.node
                    slowdown = (s.duration_s - med) / med if med > 0 else 0.0
                    if mad > 0:
                        z = MAD_TO_Z * (s.duration_s - med) / mad
                    else:
                        z = Z_CAP if s.duration_s > med else 0.0
                    slow = z > cfg.z_threshold and slowdown >= cfg.min_slowdown
                    per_rank.setdefault(rank, []).append((slow, slowdown, z, s.ts))

            slow_ranks: dict[str, list[tuple[int, list[tuple[bool, float, float, float]]]]] = {}
            for rank, history in per_rank.items():
                slow_share = sum(h[0] for h in history) / len(history)
                if slow_share < 0.5:
                    job.episode_start.pop(rank, None)  # recovered: a new episode starts afresh
                    continue
                slow_ts = [h[3] for h in history if h[0]]
                start = job.episode_start.setdefault(rank, min(slow_ts))
                if (
                    len(history) >= cfg.min_steps
                    and slow_share >= cfg.persist_fraction
                    and now - start >= cfg.min_duration_s
                ):
                    slow_ranks.setdefault(rank_node[rank], []).append((rank, history))

            for node, ranks in sorted(slow_ranks.items()):
                slow_points = [h for _, hist in ranks for h in hist if h[0]]
                evidence: dict[str, Any] = {
                    "steps_evaluated": len(steps),
                    "steps_slow": {str(r): sum(h[0] for h in hist) for r, hist in ranks},
                    "first_step": steps[0],
                    "last_step": steps[-1],
                    "job_median_step_s": round(statistics.median(medians), 6),
                    "hints": [],
                }
                evidence.update(self._hints(node, now, evidence["hints"]))
                findings.append(
                    StragglerFinding(
                        job=job_name,
                        node=node,
                        ranks=sorted(r for r, _ in ranks),
                        slowdown=round(statistics.median(h[1] for h in slow_points), 4),
                        z=round(statistics.median(h[2] for h in slow_points), 2),
                        evidence=evidence,
                        first_seen=min(job.episode_start[r] for r, _ in ranks),
                    )
                )
        return findings

    def _complete_steps(self, job: _Job) -> list[int]:
        """Steps that can be judged: enough ranks, and not the newest (still filling in)."""
        if not job.steps:
            return []
        newest = max(job.steps)
        expected = max(len(s) for s in job.steps.values())
        return [
            step
            for step in sorted(job.steps)
            if len(job.steps[step]) >= self.config.min_ranks
            and (step < newest or len(job.steps[step]) >= expected)
        ]

    def _expire(self, now: float) -> None:
        cfg = self.config
        for name in [n for n, j in self._jobs.items() if now - j.last_ts > cfg.stale_after_s]:
            del self._jobs[name]
        horizon = now - cfg.hint_window_s
        for table in (self._gpu, self._rtt):
            for node in list(table):
                samples = table[node]
                while samples and samples[0][0] < horizon:
                    samples.popleft()
                if not samples:
                    del table[node]

    def _hints(self, node: str, now: float, hints: list[str]) -> dict[str, Any]:
        """Corroborating evidence for ``node``; appends a sentence per hint to ``hints``."""
        cfg = self.config
        horizon = now - cfg.hint_window_s
        out: dict[str, Any] = {}

        gpu = [s for s in self._gpu.get(node, ()) if s[0] >= horizon]
        if gpu:
            mask = 0
            for *_, reasons in gpu:
                mask |= reasons
            out["throttle_reasons"] = mask
            names = [name for bit, name in THROTTLE_NAMES.items() if mask & bit]
            out["throttle_names"] = names
            if mask & CORROBORATING_THROTTLE:
                hints.append(f"GPU clocks throttled: {'|'.join(names)} (0x{mask:x})")
            node_clock = _node_clock(gpu)
            fleet = [
                c
                for samples in self._gpu.values()
                if (c := _node_clock([s for s in samples if s[0] >= horizon])) is not None
            ]
            if node_clock is not None:
                out["sm_clock_mhz"] = node_clock
            if node_clock is not None and len(fleet) >= 3:
                fleet_clock = statistics.median(fleet)
                out["fleet_sm_clock_mhz"] = fleet_clock
                if node_clock < fleet_clock * (1 - cfg.clock_drop):
                    hints.append(
                        f"SM clock {node_clock:g} MHz below the fleet's {fleet_clock:g} MHz"
                    )

        rtts = {
            n: statistics.median(r for ts, r in samples if ts >= horizon)
            for n, samples in self._rtt.items()
            if any(ts >= horizon for ts, _ in samples)
        }
        if node in rtts:
            out["rtt_p50_us"] = rtts[node]
            if len(rtts) >= 3:
                fleet_rtt = statistics.median(rtts.values())
                out["fleet_rtt_p50_us"] = fleet_rtt
                if fleet_rtt > 0 and rtts[node] > cfg.rtt_factor * fleet_rtt:
                    hints.append(f"RTT {rtts[node]:g} us vs fleet {fleet_rtt:g} us")
        return out


def _node_clock(samples: list[_GpuSample]) -> float | None:
    """The node's SM clock: its slowest GPU's median, since one slow GPU paces its rank."""
    per_gpu: dict[int, list[float]] = {}
    for _, gpu, clock, _ in samples:
        if clock is not None:
            per_gpu.setdefault(gpu, []).append(clock)
    return min((statistics.median(c) for c in per_gpu.values()), default=None)
