"""The node agent: runs the collectors, builds one batch per interval, hands it to the shipper.

Tasks inside one asyncio loop:

* one loop per collector, at the collector's ``interval``: a collector that raises is
  logged with its name and skipped that round; one slower than its interval skips
  the ticks it missed rather than running twice at once;
* the batch loop: every ``batch_interval`` everything collected since the last batch
  becomes a ``Batch`` with the next seq of the spool, written to the spool;
* the shipper loop, sending the spool to the backend;
* with pingmesh enabled: the UDP echo responder, the prober, and a pinglist refresh
  (ETag) that feeds the prober its peers.

SIGTERM or SIGINT stops the collectors, spools a final batch, tries one last flush
within ``final_flush_seconds`` and returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import httpx

from agents.collectors import load_collector_class
from agents.collectors.base import Collector, Roots, Samples
from agents.config import AgentConfig, iface_of_address
from agents.protocol import MAX_ROWS, Batch, Event, RegisterRequest
from agents.shipper import RegistrationError, Shipper
from agents.spool import Spool

log = logging.getLogger(__name__)

# Per-list row limits of one Batch (see protocol.Batch); a backlog of samples is split.
_LIMITS = {"probes": MAX_ROWS, "hosts": 600, "gpus": MAX_ROWS, "nics": MAX_ROWS, "events": 10_000}
# Events this grave ship at once, not at the next batch tick (Xid, NCCL timeouts, lost GPUs).
URGENT_SEVERITIES = frozenset({"error", "critical"})
URGENT_MIN_GAP_S = 0.2  # early batches are never closer together than this
_ERROR_EVENT_EVERY_S = 60.0  # at most one collector_error event per collector per minute


async def _maybe_await(value: Any) -> Any:
    """Call sites of the probe classes work whether their methods are sync or async."""
    if inspect.isawaitable(value):
        return await value
    return value


def _construct(cls: Callable[..., Any], *args: Any, **available: Any) -> Any:
    """Call ``cls`` with the keyword arguments its signature names, from ``available``.

    Collectors take different inputs (roots, globs, a prober...); each gets the
    ones it declares.
    """
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return cls(*args)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return cls(*args, **available)
    return cls(*args, **{k: v for k, v in available.items() if k in parameters})


def split_samples(samples: Samples) -> list[Samples]:
    """Cut ``samples`` into pieces that each fit the row limits of one Batch."""
    pieces = max(
        1, *((len(getattr(samples, name)) + limit - 1) // limit for name, limit in _LIMITS.items())
    )
    if pieces == 1:
        return [samples]
    out = [Samples() for _ in range(pieces)]
    for name, limit in _LIMITS.items():
        rows = getattr(samples, name)
        for index in range(0, len(rows), limit):
            getattr(out[index // limit], name).extend(rows[index : index + limit])
    return out


class AgentDaemon:
    """The node agent daemon; ``await AgentDaemon(config).run()`` until SIGTERM or ``stop()``.

    ``collectors`` replaces the ones the config names (tests and embedders);
    ``client`` is the HTTP client to use (the daemon makes and closes its own otherwise).
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        collectors: Sequence[Collector] | None = None,
        client: httpx.AsyncClient | None = None,
        roots: Roots | None = None,
    ) -> None:
        self.config = config
        self.roots = roots if roots is not None else Roots.from_env()
        self.spool = Spool(config.spool_dir, config.spool_max_bytes)
        self._own_client = client is None
        self.client = client or httpx.AsyncClient(timeout=10.0)
        self.shipper = Shipper(
            config.server,
            config.node_id,
            self.spool,
            self.client,
            bootstrap_token=config.bootstrap_token,
            registration=self._registration(),
            token_path=config.token_path,
        )
        self.collectors: list[Collector] = list(collectors) if collectors is not None else []
        self._use_configured = collectors is None
        self.prober: Any = None
        self.task_runner: Any = None
        self._ship_now = asyncio.Event()
        self._last_ship = 0.0
        self.responder: Any = None
        self.batches_built = 0
        self._pending = Samples()
        self._error_event_at: dict[str, float] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []

    # -- setup ------------------------------------------------------------------------------

    def _gpu_count(self) -> int:
        # The NVIDIA driver lists one folder per GPU here; no driver, no GPUs to report.
        gpus = self.roots.proc_path("driver", "nvidia", "gpus")
        try:
            return min(64, sum(1 for _ in gpus.iterdir()))
        except OSError:
            return 0

    def _registration(self) -> RegisterRequest:
        import socket

        return RegisterRequest(
            node=self.config.node_id,
            hostname=socket.gethostname()[:256],
            address=self.config.address,
            probe_port=self.config.probe_port,
            rack=self.config.rack,
            pod=self.config.pod,
            gpu_count=self._gpu_count(),
            labels={"job": self.config.job_id} if self.config.job_id else {},
        )

    async def _start_pingmesh(self) -> Any:
        """Start the echo responder and the prober; return the prober, or None if unavailable."""
        try:
            from agents.probes.prober import PingProber
            from agents.probes.responder import UdpEchoResponder
        except ImportError as exc:
            self._collector_failed("pingmesh", f"probe modules unavailable: {exc!r}")
            return None
        cfg = self.config
        try:
            self.responder = UdpEchoResponder(cfg.probe_bind_host, cfg.probe_port)
            await _maybe_await(self.responder.start())
            self.prober = _construct(
                PingProber, cfg.node_id, [], cfg.flows, cfg.dscp,
                port=cfg.probe_port, bind_host=cfg.probe_bind_host, source=cfg.address,
            )
            await _maybe_await(self.prober.start())
        except Exception as exc:
            self._collector_failed("pingmesh", f"cannot start the probes: {exc!r}")
            await self._stop_probes()
            return None
        return self.prober

    async def _stop_probes(self) -> None:
        for name in ("prober", "responder"):
            part = getattr(self, name)
            if part is None:
                continue
            try:
                await _maybe_await(part.stop())
            except Exception:
                log.exception("stopping the %s failed", name)
            setattr(self, name, None)

    async def _build_collectors(self) -> None:
        cfg = self.config
        for name in cfg.collectors:
            try:
                cls = load_collector_class(name)
            except Exception as exc:
                self._collector_failed(name, f"cannot load: {exc!r}")
                continue
            available: dict[str, Any] = {
                "roots": self.roots,
                "node": cfg.node_id,
                "job": cfg.job_id,
                "job_id": cfg.job_id,
                "globs": list(cfg.nccl_log_globs),
                "nccl_log_globs": list(cfg.nccl_log_globs),
                # The data-fabric interface, for collectors that watch one (pfc_sniffer).
                "iface": iface_of_address(cfg.address),
            }
            if name == "pingmesh":
                prober = await self._start_pingmesh()
                if prober is None:
                    continue
                available["prober"] = prober
                available["responder"] = self.responder
            try:
                self.collectors.append(_construct(cls, **available))
            except Exception as exc:
                self._collector_failed(name, f"cannot start: {exc!r}")

    def _collector_failed(self, name: str, message: str) -> None:
        """Log a collector failure and report it, at most once a minute per collector."""
        log.error("collector %s: %s", name, message)
        now = time.monotonic()
        last = self._error_event_at.get(name)
        if last is not None and now - last < _ERROR_EVENT_EVERY_S:
            return
        self._error_event_at[name] = now
        self._pending.events.append(
            Event(
                ts=datetime.now(UTC), kind="collector_error", severity="error",
                message=f"collector {name}: {message}"[:4096], attrs={"collector": name},
            )
        )

    # -- loops ------------------------------------------------------------------------------

    async def _run_collector(self, collector: Collector) -> None:
        name = getattr(collector, "name", type(collector).__name__)
        interval = max(0.01, float(getattr(collector, "interval", 1.0)))
        next_at = time.monotonic()
        while True:
            # Awaited inline: a slow collect() delays this loop, it never overlaps itself.
            try:
                samples = await collector.collect()
                self._pending.extend(samples)
                if samples.urgent or any(e.severity in URGENT_SEVERITIES for e in samples.events):
                    self._ship_now.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("collector %s failed this round", name)
                self._collector_failed(name, f"collect failed: {exc!r}")
            next_at += interval
            now = time.monotonic()
            if now > next_at:
                missed = int((now - next_at) // interval) + 1
                log.warning("collector %s took longer than %.2f s; skipping %d round(s)",
                            name, interval, missed)
                next_at += missed * interval
            await asyncio.sleep(next_at - now)

    async def _ship_pending(self) -> None:
        samples, self._pending = self._pending, Samples()
        for piece in split_samples(samples):
            seq = await asyncio.to_thread(self.spool.allocate_seq)
            batch = Batch(
                node=self.config.node_id,
                seq=seq,
                sent_at=datetime.now(UTC),
                probes=piece.probes,
                hosts=piece.hosts,
                gpus=piece.gpus,
                nics=piece.nics,
                events=piece.events,
            )
            await self.shipper.submit(batch)
            self.batches_built += 1

    async def _batch_loop(self) -> None:
        interval = self.config.batch_interval
        next_at = time.monotonic() + interval
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_at - time.monotonic())):
                    await self._ship_now.wait()
            if self._ship_now.is_set():
                # Early, for something urgent; not more often than URGENT_MIN_GAP_S.
                self._ship_now.clear()
                await asyncio.sleep(max(0.0, self._last_ship + URGENT_MIN_GAP_S - time.monotonic()))
            else:
                next_at = max(next_at + interval, time.monotonic())
            self._last_ship = time.monotonic()
            try:
                await self._ship_pending()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A full disk or the like: keep collecting, try again next interval.
                log.exception("cannot spool the batch; will retry next interval")

    async def _pinglist_loop(self) -> None:
        etag: str | None = None
        while True:
            try:
                pinglist, etag = await self.shipper.fetch_pinglist(etag)
                if pinglist is not None and self.prober is not None:
                    peers = [peer for peer in pinglist.peers if peer.node != self.config.node_id]
                    await _maybe_await(self.prober.set_peers(peers))
                    log.info("pinglist %s: %d peers", pinglist.version, len(peers))
            except asyncio.CancelledError:
                raise
            except (httpx.HTTPError, RegistrationError, ValueError) as exc:
                log.warning("pinglist refresh failed: %s", exc)
            except Exception:
                log.exception("pinglist refresh failed")
            await asyncio.sleep(self.config.pinglist_interval)

    # -- lifecycle --------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run`` to shut down (what SIGTERM does)."""
        self._stop.set()

    def _agent_event(self, message: str) -> None:
        self._pending.events.append(
            Event(ts=datetime.now(UTC), kind="agent", severity="info", message=message,
                  attrs={"spool_backlog": len(self.spool), "spool_dropped": self.spool.dropped})
        )

    async def run(self, install_signal_handlers: bool = True) -> int:
        """Run until SIGTERM/SIGINT or ``stop()``; return the process exit code (0)."""
        loop = asyncio.get_running_loop()
        handled: list[signal.Signals] = []
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self._on_signal, sig)
                    handled.append(sig)
        try:
            log.info(
                "meshwatch agent %s starting: server %s, collectors %s, spool %s (%d queued)",
                self.config.node_id, self.config.server, ",".join(self.config.collectors),
                self.spool.dir, len(self.spool),
            )
            self._agent_event("agent started")
            if self._use_configured:
                await self._build_collectors()
            spawn: list[Awaitable[Any]] = [self._run_collector(c) for c in self.collectors]
            spawn += [self._batch_loop(), self.shipper.run()]
            if self.prober is not None:
                spawn.append(self._pinglist_loop())
            if self.config.tasks:
                self.task_runner = self._task_runner()
                spawn.append(self.task_runner.run_forever())
            self._tasks = [asyncio.create_task(coro) for coro in spawn]
            await self._stop.wait()
            await self._shutdown()
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)
            if self._own_client:
                await self.client.aclose()
        return 0

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("received %s: shutting down", sig.name)
        self._stop.set()

    def _task_runner(self) -> Any:
        from agents.tasks import TaskRunner

        return TaskRunner(
            self.config.server,
            self.config.node_id,
            self.shipper.current_token,
            self.client,
            on_token_rejected=self.shipper.forget_token,
            bind_host=self.config.probe_bind_host,
            send_rate_limit_bps=self.config.bench_send_limit_bps,
            allowed_commands=self.config.allowed_commands,
        )

    async def _shutdown(self) -> None:
        if self.task_runner is not None:
            await self.task_runner.stop()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # Bounded: a task that ignores its cancellation must not keep the agent from exiting.
            _, stuck = await asyncio.wait(self._tasks, timeout=5.0)
            for task in stuck:
                log.error("task %s did not stop within 5 s; leaving it", task.get_coro())
        self._tasks = []
        for collector in self.collectors:
            try:
                async with asyncio.timeout(2.0):
                    await collector.close()
            except Exception:
                log.exception("closing collector %s failed", getattr(collector, "name", "?"))
        await self._stop_probes()
        self._agent_event("agent stopping")
        try:
            await self._ship_pending()
        except Exception:
            log.exception("cannot spool the final batch")
        deadline = time.monotonic() + self.config.final_flush_seconds
        drained = await self.shipper.flush(deadline=deadline)
        log.info(
            "meshwatch agent stopped: %s (%d batches left in %s)",
            "spool drained" if drained else "backend not reached in time",
            len(self.spool), self.spool.dir,
        )
