"""GpuCollector against NVML answers taken from real nvidia-smi captures.

The collector's only fake is its NVML backend: ``SmiCaptureNvml`` answers each
NVML call with the value nvidia-smi printed for it on a real GPU (see
tests/fixtures/nvml/SOURCES.md), and ``NVML_ERROR_NOT_SUPPORTED`` where it
printed N/A.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from agents.collectors.gpu import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    GpuCollector,
    NvmlBackend,
    NvmlError,
    PynvmlBackend,
    RemappedRows,
)
from agents.protocol import Batch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvml"
MIB = 1 << 20

# nvmlClocksThrottleReason* bits, by the line nvidia-smi prints for each.
THROTTLE_BITS = {
    "Idle": 0x1,
    "Applications Clocks Setting": 0x2,
    "SW Power Cap": 0x4,
    "HW Slowdown": 0x8,
    "Sync Boost": 0x10,
    "SW Thermal Slowdown": 0x20,
    "HW Thermal Slowdown": 0x40,
    "HW Power Brake Slowdown": 0x80,
    "Display Clock Setting": 0x100,
}


def parse_smi_q(text: str) -> dict[str, str]:
    """``nvidia-smi -q`` of one GPU -> {"Section/Sub/Key": "value"}."""
    values: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("=") or not line.startswith("    "):
            continue
        indent = len(line) - len(line.lstrip())
        key, sep, value = line.strip().partition(":")
        key = key.strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([s for _, s in stack] + [key])
        if sep and value.strip():
            values[path] = value.strip()
        else:
            stack.append((indent, key))
    return values


def parse_nvlink_e(text: str) -> dict[int, dict[str, int]]:
    """``nvidia-smi nvlink -e`` -> {link: {"Replay": n, "Recovery": n, "CRC": n}}."""
    links: dict[int, dict[str, int]] = {}
    for m in re.finditer(r"Link (\d+): (\w+) Errors: (\d+)", text):
        links.setdefault(int(m[1]), {})[m[2]] = int(m[3])
    return links


class SmiCaptureNvml(NvmlBackend):
    """An NVML backend answering from nvidia-smi captures, one per GPU."""

    def __init__(self, captures: list[str], nvlink: list[str | None] | None = None) -> None:
        self.gpus = [parse_smi_q(c) for c in captures]
        self.nvlinks = [parse_nvlink_e(t) if t else {} for t in (nvlink or [None] * len(captures))]
        self.lost: set[int] = set()
        self.calls: dict[str, int] = {}
        self.init_error: int | None = None
        self.init_calls = 0

    # Each handle is the GPU index; every call checks the GPU is still there.
    def _get(self, h: int, call: str, *keys: str) -> str:
        self.calls[call] = self.calls.get(call, 0) + 1
        if h in self.lost:
            raise NvmlError(NVML_ERROR_GPU_IS_LOST)
        for key in keys:
            value = self.gpus[h].get(key)
            if value is not None:
                if value == "N/A":
                    raise NvmlError(NVML_ERROR_NOT_SUPPORTED)
                return value
        raise NvmlError(NVML_ERROR_NOT_SUPPORTED)

    @staticmethod
    def _number(value: str) -> float:
        return float(value.split()[0])

    def init(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise NvmlError(self.init_error)

    def shutdown(self) -> None:
        pass

    def device_count(self) -> int:
        return len(self.gpus)

    def handle(self, index: int) -> Any:
        if index in self.lost:
            raise NvmlError(NVML_ERROR_GPU_IS_LOST)
        return index

    def uuid(self, h: Any) -> str:
        return self._get(h, "uuid", "GPU UUID")

    def pci_bus_id(self, h: Any) -> str:
        return self._get(h, "pci", "PCI/Bus Id")

    def utilization_gpu_pct(self, h: Any) -> int:
        return int(self._number(self._get(h, "util", "Utilization/Gpu")))

    def memory_used_bytes(self, h: Any) -> int:
        return int(self._number(self._get(h, "mem", "FB Memory Usage/Used"))) * MIB

    def temperature_c(self, h: Any) -> int:
        return int(self._number(self._get(h, "temp", "Temperature/GPU Current Temp")))

    def power_mw(self, h: Any) -> int:
        watts = self._get(h, "power", "GPU Power Readings/Power Draw", "Power Readings/Power Draw")
        return round(self._number(watts) * 1000)

    def sm_clock_mhz(self, h: Any) -> int:
        return int(self._number(self._get(h, "sm_clock", "Clocks/SM")))

    def throttle_reasons(self, h: Any) -> int:
        self._get(h, "throttle", "Performance State")
        mask = 0
        for section in ("Clocks Event Reasons", "Clocks Throttle Reasons"):
            for key, value in self.gpus[h].items():
                if key.startswith(section + "/") and value == "Active":
                    mask |= THROTTLE_BITS[key.rsplit("/", 1)[-1]]
        return mask

    def ecc_total(self, h: Any, uncorrected: bool, aggregate: bool) -> int:
        scope = "Aggregate" if aggregate else "Volatile"
        kind = "Uncorrectable" if uncorrected else "Correctable"
        # The total NVML returns covers every location: SRAM and DRAM.
        return sum(
            int(self._get(h, "ecc", f"ECC Errors/{scope}/{where} {kind}"))
            for where in ("SRAM", "DRAM")
        )

    def retired_pages(self, h: Any, double_bit: bool) -> int:
        key = "Double Bit ECC" if double_bit else "Single Bit ECC"
        return int(self._get(h, "retired", f"Retired Pages/{key}"))

    def remapped_rows(self, h: Any) -> RemappedRows:
        get = self._get
        return RemappedRows(
            correctable=int(get(h, "rows", "Remapped Rows/Correctable Error")),
            uncorrectable=int(get(h, "rows", "Remapped Rows/Uncorrectable Error")),
            pending=get(h, "rows", "Remapped Rows/Pending") == "Yes",
            failure=get(h, "rows", "Remapped Rows/Remapping Failure Occurred") == "Yes",
        )

    def pcie_replay(self, h: Any) -> int:
        return int(self._get(h, "replay", "PCI/Replays Since Reset"))

    def nvlink_active(self, h: Any, link: int) -> bool:
        self.calls["nvlink_state"] = self.calls.get("nvlink_state", 0) + 1
        links = self.nvlinks[h]
        if h in self.lost:
            raise NvmlError(NVML_ERROR_GPU_IS_LOST)
        if links and link > max(links):
            raise NvmlError(NVML_ERROR_INVALID_ARGUMENT)
        if link not in links:
            raise NvmlError(NVML_ERROR_NOT_SUPPORTED)
        return True

    def nvlink_error_counter(self, h: Any, link: int, counter: int) -> int:
        self.calls["nvlink_counter"] = self.calls.get("nvlink_counter", 0) + 1
        # nvidia-smi prints replay, recovery, and one CRC figure (the flit CRC count).
        name = {0: "Replay", 1: "Recovery", 2: "CRC"}.get(counter)
        if name is None:
            raise NvmlError(NVML_ERROR_NOT_SUPPORTED)
        return self.nvlinks[h][link][name]


def capture(name: str) -> str:
    return (FIXTURES / name).read_text()


def h100() -> SmiCaptureNvml:
    return SmiCaptureNvml([capture("h100_sxm_nvidia_smi_a.txt")], [capture("h100_nvlink_e.txt")])


async def test_h100_reports_every_field() -> None:
    collector = GpuCollector(backend=h100())
    samples = await collector.collect()
    assert samples.events == [] and len(samples.gpus) == 1
    s = samples.gpus[0]
    assert s.gpu == 0
    assert s.uuid == "GPU-10f35015-e921-bfab-2eb8-4e9b6664d5f1"
    assert s.pci_bus_id == "00000000:19:00.0"
    assert s.util_pct == 0
    assert s.mem_used_bytes == 2 * MIB
    assert s.temp_c == 33
    assert s.power_w == pytest.approx(72.02)
    assert s.sm_clock_mhz == 345
    assert s.throttle_reasons == 0x1  # only "Idle: Active"
    assert (s.ecc_volatile_sbe, s.ecc_volatile_dbe) == (0, 0)
    assert (s.ecc_aggregate_sbe, s.ecc_aggregate_dbe) == (0, 0)
    assert s.retired_pages is None  # Hopper remaps rows; page retirement is N/A
    assert (s.remapped_rows_pending, s.remapped_rows_failed) == (0, 0)
    assert s.pcie_replay == 0
    assert s.nvlink_errors == 0
    # What the agent ships is what the backend accepts.
    Batch.model_validate({"node": "n1", "seq": 1, "sent_at": s.ts, "gpus": [s.model_dump()]})


async def test_each_nvml_reading_lands_in_its_own_field() -> None:
    """Distinct values per call (not from a capture) prove nothing is crossed or dropped."""

    class Distinct(SmiCaptureNvml):
        def ecc_total(self, h: Any, uncorrected: bool, aggregate: bool) -> int:
            return {(False, False): 11, (True, False): 12, (False, True): 13, (True, True): 14}[
                (uncorrected, aggregate)
            ]

        def retired_pages(self, h: Any, double_bit: bool) -> int:
            return 3 if double_bit else 4

        def remapped_rows(self, h: Any) -> RemappedRows:
            return RemappedRows(2, 1, pending=True, failure=False)

        def pcie_replay(self, h: Any) -> int:
            return 77

        def nvlink_error_counter(self, h: Any, link: int, counter: int) -> int:
            return 100 * link + counter

    backend = Distinct([capture("h100_sxm_nvidia_smi_a.txt")], [capture("h100_nvlink_e.txt")])
    s = (await GpuCollector(backend=backend).collect()).gpus[0]
    assert (s.ecc_volatile_sbe, s.ecc_volatile_dbe, s.ecc_aggregate_sbe, s.ecc_aggregate_dbe) == (
        11, 12, 13, 14)
    assert s.retired_pages == 7
    assert (s.remapped_rows_pending, s.remapped_rows_failed) == (1, 0)
    assert s.pcie_replay == 77
    # Links 0, 1 and 17 are the ones the capture shows up; four counters each.
    assert s.nvlink_errors == sum(100 * link + c for link in (0, 1, 17) for c in range(4))


async def test_not_supported_readings_are_none_and_not_asked_again() -> None:
    backend = SmiCaptureNvml([capture("h800_nvidia_smi_q.txt")])  # ECC disabled, no nvlink -e
    collector = GpuCollector(backend=backend)
    s = (await collector.collect()).gpus[0]
    assert s.uuid == "GPU-34bf77d1-c686-6821-79a8-32d326c5039c"
    assert s.pci_bus_id == "00000000:18:00.0"
    assert s.temp_c == 35 and s.power_w == pytest.approx(74.71) and s.sm_clock_mhz == 345
    assert s.mem_used_bytes == 0 and s.throttle_reasons == 0x1
    assert s.ecc_volatile_sbe is None and s.ecc_volatile_dbe is None
    assert s.ecc_aggregate_sbe is None and s.ecc_aggregate_dbe is None
    assert s.retired_pages is None
    assert s.nvlink_errors is None
    assert (s.remapped_rows_pending, s.remapped_rows_failed) == (0, 0)
    asked = dict(backend.calls)
    s2 = (await collector.collect()).gpus[0]
    assert s2.temp_c == 35 and s2.ecc_volatile_sbe is None
    # Supported readings are read again each second; unsupported ones are not.
    assert backend.calls["temp"] == asked["temp"] + 1
    assert backend.calls["ecc"] == asked["ecc"]
    assert backend.calls["retired"] == asked["retired"]
    assert backend.calls["nvlink_state"] == asked["nvlink_state"]


async def test_no_driver_is_quiet_and_retried_later(caplog: pytest.LogCaptureFixture) -> None:
    backend = h100()
    backend.init_error = NVML_ERROR_DRIVER_NOT_LOADED
    now = [1000.0]
    collector = GpuCollector(backend=backend, retry_init_s=300, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="agents.collectors.gpu"):
        for _ in range(5):
            samples = await collector.collect()
            assert len(samples) == 0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "NVML unavailable" in warnings[0].getMessage()
    assert backend.init_calls == 1
    # The driver is loaded later: the next try after the retry period finds the GPU.
    backend.init_error = None
    now[0] += 301
    samples = await collector.collect()
    assert backend.init_calls == 2 and len(samples.gpus) == 1


async def test_real_nvml_without_a_driver_reports_nothing() -> None:
    probe = PynvmlBackend()
    try:
        probe.init()
    except NvmlError:
        pass
    else:
        probe.shutdown()
        pytest.skip("this machine has a working NVML; the no-driver case needs one without")
    collector = GpuCollector()
    assert len(await collector.collect()) == 0
    assert collector.available is False
    await collector.close()


async def test_lost_gpu_gives_one_event_and_the_others_keep_reporting() -> None:
    backend = SmiCaptureNvml(
        [capture("h100_sxm_nvidia_smi_a.txt"), capture("h800_nvidia_smi_q.txt")],
        [capture("h100_nvlink_e.txt"), None],
    )
    collector = GpuCollector(backend=backend)
    first = await collector.collect()
    assert [g.gpu for g in first.gpus] == [0, 1] and first.events == []

    backend.lost.add(1)
    second = await collector.collect()
    assert [g.gpu for g in second.gpus] == [0]
    assert len(second.events) == 1
    ev = second.events[0]
    assert ev.kind == "gpu_lost" and ev.severity == "critical"
    assert ev.attrs == {"gpu": 1, "pci": "00000000:18:00.0",
                        "uuid": "GPU-34bf77d1-c686-6821-79a8-32d326c5039c"}
    assert "NVML_ERROR_GPU_IS_LOST" in ev.message

    third = await collector.collect()
    assert [g.gpu for g in third.gpus] == [0] and third.events == []  # said once

    backend.lost.discard(1)
    fourth = await collector.collect()
    assert [g.gpu for g in fourth.gpus] == [0, 1] and fourth.events == []
