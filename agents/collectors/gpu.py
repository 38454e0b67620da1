"""Per-GPU health and load through NVML, once a second.

Every reading the backend stores for a GPU (``agents.protocol.GpuSample``):
utilisation, memory used, temperature, power, SM clock and the active clock
throttle reasons, ECC counts (volatile and aggregate, corrected and
uncorrected), retired pages, row-remapper state, the PCIe replay counter and
the NVLink error counters of the links that are up.

NVML is reached through ``NvmlBackend``, a class with the dozen calls this
collector makes; ``PynvmlBackend`` implements it with ``nvidia-ml-py``. Tests
replace the backend only, with one that answers from captured
``nvidia-smi -q`` output.

* No library, no driver, no GPU: the collector says so once in the log and
  reports nothing; the agent runs on. It tries NVML again every few minutes,
  since a driver may be loaded after the agent started.
* A reading a GPU does not support (``NVML_ERROR_NOT_SUPPORTED``, what
  nvidia-smi prints as N/A) is None in the sample, and is not asked again.
* A GPU that answers ``NVML_ERROR_GPU_IS_LOST`` (fallen off the bus) gives one
  ``gpu_lost`` event, and no samples until it answers again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, TypeVar

from agents.collectors.base import Collector, Samples
from agents.protocol import Event, GpuSample

log = logging.getLogger(__name__)

T = TypeVar("T")

# NVML return codes (nvml.h, nvmlReturn_t); the same numbers pynvml exposes.
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

# nvmlNvLinkErrorCounter_t: what `nvidia-smi nvlink -e` sums up per link.
NVLINK_COUNTERS = {"replay": 0, "recovery": 1, "crc_flit": 2, "crc_data": 3}
NVLINK_MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS of current drivers (18 on H100)

RETRY_INIT_S = 300.0


class NvmlError(Exception):
    """An NVML call that failed, with its ``nvmlReturn_t`` code."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message or f"NVML error {code}")
        self.code = code


@dataclass(frozen=True)
class RemappedRows:
    """nvmlDeviceGetRemappedRows: rows remapped for each cause, and the two flags."""

    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


class NvmlBackend:
    """The NVML calls the collector makes. Every method raises ``NvmlError`` on failure.

    ``handle`` is whatever the backend uses to name a device; the collector
    only passes it back.
    """

    def init(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def device_count(self) -> int:
        raise NotImplementedError

    def handle(self, index: int) -> Any:
        raise NotImplementedError

    def uuid(self, handle: Any) -> str:
        raise NotImplementedError

    def pci_bus_id(self, handle: Any) -> str:
        raise NotImplementedError

    def utilization_gpu_pct(self, handle: Any) -> int:
        raise NotImplementedError

    def memory_used_bytes(self, handle: Any) -> int:
        raise NotImplementedError

    def temperature_c(self, handle: Any) -> int:
        raise NotImplementedError

    def power_mw(self, handle: Any) -> int:
        raise NotImplementedError

    def sm_clock_mhz(self, handle: Any) -> int:
        raise NotImplementedError

    def throttle_reasons(self, handle: Any) -> int:
        raise NotImplementedError

    def ecc_total(self, handle: Any, uncorrected: bool, aggregate: bool) -> int:
        raise NotImplementedError

    def retired_pages(self, handle: Any, double_bit: bool) -> int:
        """How many pages were retired for this cause."""
        raise NotImplementedError

    def remapped_rows(self, handle: Any) -> RemappedRows:
        raise NotImplementedError

    def pcie_replay(self, handle: Any) -> int:
        raise NotImplementedError

    def nvlink_active(self, handle: Any, link: int) -> bool:
        raise NotImplementedError

    def nvlink_error_counter(self, handle: Any, link: int, counter: int) -> int:
        raise NotImplementedError


class PynvmlBackend(NvmlBackend):
    """``NvmlBackend`` on nvidia-ml-py (module ``pynvml``)."""

    def __init__(self) -> None:
        self._nvml: Any = None

    def _call(self, name: str, *args: Any) -> Any:
        nvml = self._nvml
        try:
            return getattr(nvml, name)(*args)
        except nvml.NVMLError as exc:
            raise NvmlError(int(exc.value), str(exc)) from None

    def init(self) -> None:
        try:
            import pynvml  # type: ignore[import-untyped]
        except ImportError as exc:  # the agent extra without nvidia-ml-py
            raise NvmlError(NVML_ERROR_LIBRARY_NOT_FOUND, f"pynvml not installed: {exc}") from None
        self._nvml = pynvml
        self._call("nvmlInit")

    def shutdown(self) -> None:
        if self._nvml is not None:
            self._call("nvmlShutdown")

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def handle(self, index: int) -> Any:
        return self._call("nvmlDeviceGetHandleByIndex", index)

    def uuid(self, handle: Any) -> str:
        return _text(self._call("nvmlDeviceGetUUID", handle))

    def pci_bus_id(self, handle: Any) -> str:
        return _text(self._call("nvmlDeviceGetPciInfo", handle).busId)

    def utilization_gpu_pct(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetUtilizationRates", handle).gpu)

    def memory_used_bytes(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetMemoryInfo", handle).used)

    def temperature_c(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetTemperature", handle, self._nvml.NVML_TEMPERATURE_GPU))

    def power_mw(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetPowerUsage", handle))

    def sm_clock_mhz(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetClockInfo", handle, self._nvml.NVML_CLOCK_SM))

    def throttle_reasons(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetCurrentClocksThrottleReasons", handle))

    def ecc_total(self, handle: Any, uncorrected: bool, aggregate: bool) -> int:
        nvml = self._nvml
        kind = (
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            if uncorrected
            else nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        )
        counter = nvml.NVML_AGGREGATE_ECC if aggregate else nvml.NVML_VOLATILE_ECC
        return int(self._call("nvmlDeviceGetTotalEccErrors", handle, kind, counter))

    def retired_pages(self, handle: Any, double_bit: bool) -> int:
        nvml = self._nvml
        cause = (
            nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            if double_bit
            else nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
        )
        return len(self._call("nvmlDeviceGetRetiredPages", handle, cause))

    def remapped_rows(self, handle: Any) -> RemappedRows:
        corr, unc, pending, failure = self._call("nvmlDeviceGetRemappedRows", handle)
        return RemappedRows(int(corr), int(unc), bool(pending), bool(failure))

    def pcie_replay(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetPcieReplayCounter", handle))

    def nvlink_active(self, handle: Any, link: int) -> bool:
        return int(self._call("nvmlDeviceGetNvLinkState", handle, link)) == 1

    def nvlink_error_counter(self, handle: Any, link: int, counter: int) -> int:
        return int(self._call("nvmlDeviceGetNvLinkErrorCounter", handle, link, counter))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class _GpuLost(Exception):
    pass


@dataclass
class _Device:
    index: int
    handle: Any = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)
    failing: set[str] = field(default_factory=set)
    nvlinks: list[int] | None = None  # links found up; None until looked for


class GpuCollector(Collector):
    """NVML readings of every GPU of the node, as ``GpuSample``s; ``gpu_lost`` events."""

    name: ClassVar[str] = "gpu"

    def __init__(
        self,
        backend: NvmlBackend | None = None,
        interval: float = 1.0,
        retry_init_s: float = RETRY_INIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend if backend is not None else PynvmlBackend()
        self.interval = interval
        self.retry_init_s = retry_init_s
        self._clock = clock
        self.available: bool | None = None  # None: not tried yet
        self._next_init_at = 0.0
        self._devices: list[_Device] = []

    # -- setup --------------------------------------------------------------------------------

    def _start(self) -> bool:
        if self.available:
            return True
        now = self._clock()
        if self.available is False and now < self._next_init_at:
            return False
        first = self.available is None
        try:
            self.backend.init()
            count = self.backend.device_count()
        except NvmlError as exc:
            self._next_init_at = now + self.retry_init_s
            if first:
                log.warning("gpu: NVML unavailable (%s); reporting no GPU data", exc)
            self.available = False
            return False
        if count == 0:
            self._next_init_at = now + self.retry_init_s
            if first:
                log.warning("gpu: NVML finds no GPU; reporting no GPU data")
            self.available = False
            return False
        self._devices = [_Device(i) for i in range(count)]
        self.available = True
        log.info("gpu: NVML reports %d GPU(s)", count)
        return True

    # -- reading ------------------------------------------------------------------------------

    def _read(self, dev: _Device, name: str, call: Callable[[], T]) -> T | None:
        """One NVML reading; None where unsupported or failing, _GpuLost when the GPU is gone."""
        if name in dev.unsupported:
            return None
        try:
            value = call()
        except NvmlError as exc:
            if exc.code == NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost from None
            if exc.code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
                dev.unsupported.add(name)
            elif name not in dev.failing:
                dev.failing.add(name)
                log.warning("gpu %d: reading %s failed: %s", dev.index, name, exc)
            return None
        dev.failing.discard(name)
        return value

    def _nvlink_errors(self, dev: _Device) -> int | None:
        b = self.backend
        if dev.nvlinks is None:
            links = []
            for link in range(NVLINK_MAX_LINKS):
                try:
                    if b.nvlink_active(dev.handle, link):
                        links.append(link)
                except NvmlError as exc:
                    if exc.code == NVML_ERROR_GPU_IS_LOST:
                        raise _GpuLost from None
                    if exc.code == NVML_ERROR_INVALID_ARGUMENT:
                        break  # past the device's last link
                    continue  # a link the device lacks, or that is off
            dev.nvlinks = links
        if not dev.nvlinks:
            return None
        total: int | None = None
        for link in dev.nvlinks:
            for cname, counter in NVLINK_COUNTERS.items():
                value = self._read(
                    dev,
                    f"nvlink{link}.{cname}",
                    functools.partial(b.nvlink_error_counter, dev.handle, link, counter),
                )
                if value is not None:
                    total = (total or 0) + value
        return total

    def _sample(self, dev: _Device) -> GpuSample:
        b = self.backend
        h = dev.handle
        if dev.uuid is None:
            dev.uuid = self._read(dev, "uuid", lambda: b.uuid(h))
            dev.pci_bus_id = self._read(dev, "pci_bus_id", lambda: b.pci_bus_id(h))
        power_mw = self._read(dev, "power", lambda: b.power_mw(h))
        retired = [
            self._read(dev, f"retired_pages.{cause}", functools.partial(b.retired_pages, h, double))
            for cause, double in (("sbe", False), ("dbe", True))
        ]
        rows = self._read(dev, "remapped_rows", lambda: b.remapped_rows(h))

        def ecc(uncorrected: bool, aggregate: bool) -> int | None:
            name = f"ecc.{'dbe' if uncorrected else 'sbe'}.{'agg' if aggregate else 'vol'}"
            return self._read(dev, name, lambda: b.ecc_total(h, uncorrected, aggregate))

        return GpuSample(
            ts=datetime.now(UTC),
            gpu=dev.index,
            uuid=dev.uuid,
            pci_bus_id=dev.pci_bus_id,
            util_pct=self._read(dev, "util", lambda: b.utilization_gpu_pct(h)),
            mem_used_bytes=self._read(dev, "mem_used", lambda: b.memory_used_bytes(h)),
            temp_c=self._read(dev, "temp", lambda: b.temperature_c(h)),
            power_w=None if power_mw is None else power_mw / 1000.0,
            sm_clock_mhz=self._read(dev, "sm_clock", lambda: b.sm_clock_mhz(h)),
            throttle_reasons=self._read(dev, "throttle", lambda: b.throttle_reasons(h)),
            ecc_volatile_sbe=ecc(False, False),
            ecc_volatile_dbe=ecc(True, False),
            ecc_aggregate_sbe=ecc(False, True),
            ecc_aggregate_dbe=ecc(True, True),
            retired_pages=None if retired == [None, None] else sum(r or 0 for r in retired),
            # The row remapper's two flags, as 0/1: a remap waits for a GPU
            # reset; a remap failed (the bank is out of spare rows).
            remapped_rows_pending=None if rows is None else int(rows.pending),
            remapped_rows_failed=None if rows is None else int(rows.failure),
            pcie_replay=self._read(dev, "pcie_replay", lambda: b.pcie_replay(h)),
            nvlink_errors=self._nvlink_errors(dev),
        )

    def _lost_event(self, dev: _Device) -> Event:
        attrs: dict[str, Any] = {"gpu": dev.index}
        if dev.pci_bus_id:
            attrs["pci"] = dev.pci_bus_id
        if dev.uuid:
            attrs["uuid"] = dev.uuid
        where = f" ({dev.pci_bus_id})" if dev.pci_bus_id else ""
        return Event(
            ts=datetime.now(UTC),
            kind="gpu_lost",
            severity="critical",
            message=f"GPU {dev.index}{where} is lost: NVML_ERROR_GPU_IS_LOST",
            attrs=attrs,
        )

    def _collect_sync(self) -> Samples:
        samples = Samples()
        if not self._start():
            return samples
        for dev in self._devices:
            try:
                if dev.handle is None:
                    try:
                        dev.handle = self.backend.handle(dev.index)
                    except NvmlError as exc:
                        if exc.code == NVML_ERROR_GPU_IS_LOST:
                            raise _GpuLost from None
                        log.warning("gpu %d: no NVML handle: %s", dev.index, exc)
                        continue
                sample = self._sample(dev)
            except _GpuLost:
                if not dev.lost:
                    dev.lost = True
                    log.error("gpu %d (%s): lost (NVML_ERROR_GPU_IS_LOST)", dev.index,
                              dev.pci_bus_id or "?")
                    samples.events.append(self._lost_event(dev))
                continue
            if dev.lost:
                dev.lost = False
                log.warning("gpu %d answers NVML again", dev.index)
            samples.gpus.append(sample)
        return samples

    async def collect(self) -> Samples:
        # NVML calls block, for seconds on a GPU that is going away: keep them off the loop.
        return await asyncio.to_thread(self._collect_sync)

    async def close(self) -> None:
        if self.available:
            try:
                await asyncio.to_thread(self.backend.shutdown)
            except NvmlError as exc:
                log.debug("gpu: nvmlShutdown failed: %s", exc)
        self.available = None
        self._devices = []
