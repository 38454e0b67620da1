"""The agent's task runner: benchmark runs the backend asks for while it bisects.

:class:`TaskRunner` long-polls ``GET /api/v1/agents/{node}/tasks?wait=...``,
runs each task it is given through :mod:`agents.benchmarks` (at the same time
as the others, each within the task's deadline), and posts
``{"figure": ...}`` or ``{"error": ...}`` to
``/api/v1/agents/{node}/tasks/{id}/result``. A result that cannot be
delivered (backend restarting) is retried until a while after the deadline.

Task kinds (the ``spec`` of each is set by the backend):

* ``net-ring``: listen on ``spec.port`` for the predecessor's stream while
  streaming ``spec.nbytes`` to ``spec.send_to`` (address, port); the figure
  is the incoming hop's Gbit/s, since each receiver measures its hop;
* ``gemm``: ``run_gemm(spec.size, spec.seconds)``, GFLOP/s;
* ``command``: ``run_command(spec.argv, spec.pattern)``; refused unless the
  agent allows that program (``allowed_commands``), since it runs with the
  agent's privileges.

``send_rate_limit_bps`` paces this node's ring sends to a bit rate: a real
throttle on a real TCP stream, for labs and tests that need a slow node.

This module belongs to the agent: it never imports ``app``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

import httpx

from agents.benchmarks import (
    BenchmarkError,
    BenchmarkTimeout,
    net_ring_receive,
    net_ring_send,
    run_command,
    run_gemm,
)

log = logging.getLogger(__name__)

TokenProvider = Callable[[], Awaitable[str] | str]

# Stop measuring this long before the backend's deadline, so the result arrives in time.
_DEADLINE_MARGIN_S = 2.0
_DEADLINE_MARGIN_FRACTION = 0.1
# Keep trying to deliver a result this long after the deadline: a backend that
# was restarting accepts it until its driver expires the task.
_POST_GRACE_S = 60.0


class TaskError(RuntimeError):
    """A task that cannot run here (bad spec, forbidden command)."""


def run_budget(timeout_s: float) -> float:
    """Seconds a task may measure for, out of the ``timeout_s`` left until its deadline."""
    margin = min(_DEADLINE_MARGIN_S, timeout_s * _DEADLINE_MARGIN_FRACTION)
    return max(0.1, timeout_s - margin)


class TaskRunner:
    """Runs the backend's benchmark tasks on this node: long-poll, run, post the result.

    ``token_provider`` returns the node token (sync or async; the shipper's,
    which registers first if there is none); ``on_token_rejected(token)`` is
    called when the backend answers 401 with it, so the next call of the
    provider gets a fresh one. ``client`` is shared with the rest of the
    agent; per-request timeouts are set here, so its default does not cut
    the long poll short.
    """

    def __init__(
        self,
        server: str,
        node: str,
        token_provider: TokenProvider,
        client: httpx.AsyncClient,
        *,
        on_token_rejected: Callable[[str], object] | None = None,
        wait_s: float = 25.0,
        bind_host: str = "0.0.0.0",
        send_rate_limit_bps: float | None = None,
        allowed_commands: Collection[str] = (),
        retry_base_s: float = 0.5,
        retry_cap_s: float = 10.0,
    ) -> None:
        if not 0 <= wait_s <= 60:
            raise ValueError("wait_s must be within 0..60")
        if send_rate_limit_bps is not None and send_rate_limit_bps <= 0:
            raise ValueError("send_rate_limit_bps must be positive")
        self.server = server.rstrip("/")
        self.node = node
        self.token_provider = token_provider
        self.on_token_rejected = on_token_rejected
        self.client = client
        self.wait_s = wait_s
        self.bind_host = bind_host
        self.send_rate_limit_bps = send_rate_limit_bps
        self.allowed_commands = frozenset(allowed_commands)
        self.retry_base_s = retry_base_s
        self.retry_cap_s = retry_cap_s
        self.tasks_run = 0
        self.results_posted = 0
        self._rng = random.Random()
        self._running: dict[int, asyncio.Task[None]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False

    # -- http -------------------------------------------------------------------------------

    @property
    def _tasks_url(self) -> str:
        return f"{self.server}/api/v1/agents/{self.node}/tasks"

    async def _token(self) -> str:
        token = self.token_provider()
        if inspect.isawaitable(token):
            token = await token
        return str(token)

    def _rejected(self, token: str) -> None:
        if self.on_token_rejected is not None:
            self.on_token_rejected(token)

    def _backoff(self, attempt: int) -> float:
        delay = min(self.retry_cap_s, self.retry_base_s * 2**attempt)
        return delay * (0.5 + self._rng.random() / 2)  # jitter: agents do not retry in step

    async def poll_once(self) -> list[dict[str, Any]]:
        """One long poll; the tasks it returned (already marked running by the backend)."""
        token = await self._token()
        response = await self.client.get(
            self._tasks_url,
            params={"wait": self.wait_s},
            headers={"Authorization": f"Bearer {token}"},
            timeout=self.wait_s + 15.0,
        )
        if response.status_code == 401:
            self._rejected(token)
        response.raise_for_status()
        tasks = response.json()
        if not isinstance(tasks, list):
            raise ValueError(f"task list expected, got {type(tasks).__name__}")
        return tasks

    async def post_result(self, task_id: int, body: Mapping[str, Any], give_up_at: float) -> bool:
        """Deliver one result, retrying until ``give_up_at`` (monotonic); True if accepted."""
        url = f"{self._tasks_url}/{task_id}/result"
        attempt = 0
        while True:
            try:
                token = await self._token()
                response = await self.client.post(
                    url, json=dict(body), headers={"Authorization": f"Bearer {token}"},
                    timeout=10.0,
                )
                if response.status_code == 200:
                    self.results_posted += 1
                    return True
                if response.status_code == 401:
                    self._rejected(token)
                elif response.status_code < 500 and response.status_code != 429:
                    # Expired, unknown or refused: retrying will not change the answer.
                    log.warning("task %s: result refused (%s): %s", task_id,
                                response.status_code, response.text[:300])
                    return False
            except httpx.HTTPError as exc:
                log.info("task %s: result not delivered yet: %s", task_id, exc)
            delay = self._backoff(attempt)
            attempt += 1
            if time.monotonic() + delay > give_up_at:
                log.warning("task %s: giving up delivering its result", task_id)
                return False
            await asyncio.sleep(delay)

    # -- benchmarks -------------------------------------------------------------------------

    async def _net_ring(self, spec: Mapping[str, Any], timeout: float) -> tuple[float, dict]:
        nbytes = int(spec["nbytes"])
        target = spec["send_to"]
        host, port = str(target["address"]), int(target["port"])
        receive = net_ring_receive(self.bind_host, int(spec["port"]), nbytes, timeout)
        send = net_ring_send(host, port, nbytes, timeout, rate_bps=self.send_rate_limit_bps)
        received, sent = await asyncio.gather(receive, send, return_exceptions=True)
        for outcome in (received, sent):
            if isinstance(outcome, BaseException):
                raise outcome
        assert isinstance(received, float) and isinstance(sent, float)
        detail = {
            "receive_gbps": received,
            "send_gbps": sent,
            "from": spec.get("receive_from"),
            "to": target.get("node"),
        }
        if self.send_rate_limit_bps is not None:
            detail["send_rate_limit_bps"] = self.send_rate_limit_bps
        return received, detail

    async def _command(self, spec: Mapping[str, Any], timeout: float) -> tuple[float, dict]:
        argv = [str(a) for a in spec["argv"]]
        if not argv or not ("*" in self.allowed_commands or argv[0] in self.allowed_commands):
            raise TaskError(
                f"command {argv[0] if argv else ''!r} is not allowed on this agent "
                "(allowed_commands)"
            )
        figure = await run_command(argv, str(spec["pattern"]), timeout)
        return figure, {"argv0": argv[0]}

    async def _gemm(self, spec: Mapping[str, Any], timeout: float) -> tuple[float, dict]:
        size, seconds = int(spec.get("size", 4096)), float(spec.get("seconds", 5.0))
        if seconds >= timeout:
            raise TaskError(f"gemm for {seconds}s does not fit in the {timeout:.1f}s left")
        try:
            figure = await asyncio.wait_for(run_gemm(size, seconds), timeout)
        except TimeoutError:
            raise BenchmarkTimeout(f"gemm not done within {timeout:.1f}s") from None
        return figure, {"size": size, "seconds": seconds}

    async def run_task(self, task: Mapping[str, Any]) -> dict[str, Any]:
        """Run one task within its time and return the result body to post."""
        kind = task.get("kind")
        spec = task.get("spec") or {}
        budget = run_budget(float(task.get("timeout_s", 60.0)))
        runners = {"net-ring": self._net_ring, "gemm": self._gemm, "command": self._command}
        started = time.perf_counter()
        try:
            if kind not in runners:
                raise TaskError(f"unknown task kind {kind!r}")
            figure, detail = await runners[kind](spec, budget)
        except asyncio.CancelledError:
            raise
        except (BenchmarkError, TaskError, ValueError, KeyError, TypeError, OSError) as exc:
            log.warning("task %s (%s) failed: %s", task.get("id"), kind, exc)
            return {"error": f"{type(exc).__name__}: {exc}"[:4096],
                    "detail": {"seconds": round(time.perf_counter() - started, 3)}}
        self.tasks_run += 1
        detail["seconds"] = round(time.perf_counter() - started, 3)
        return {"figure": figure, "detail": detail}

    # -- lifecycle --------------------------------------------------------------------------

    async def _handle(self, task: Mapping[str, Any]) -> None:
        task_id = int(task["id"])
        give_up_at = time.monotonic() + float(task.get("timeout_s", 60.0)) + _POST_GRACE_S
        try:
            body = await self.run_task(task)
            await self.post_result(task_id, body, give_up_at)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("task %s: unexpected failure", task_id)
        finally:
            self._running.pop(task_id, None)

    async def _poll_loop(self) -> None:
        attempt = 0
        while not self._stopping:
            try:
                tasks = await self.poll_once()
                attempt = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # backend away, restarting, or answering nonsense
                delay = self._backoff(attempt)
                attempt += 1
                log.info("task poll failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                continue
            for task in tasks:
                task_id = int(task["id"])
                if task_id not in self._running:
                    log.info("task %s: %s", task_id, task.get("kind"))
                    self._running[task_id] = asyncio.create_task(self._handle(task))

    async def run_forever(self) -> None:
        """Poll for tasks and run them until :meth:`stop`."""
        self._stopping = False
        self._loop_task = asyncio.create_task(self._poll_loop())
        try:
            await self._loop_task
        except asyncio.CancelledError:
            if not self._stopping:
                raise
        finally:
            await self._cancel_all()

    async def stop(self) -> None:
        """Stop polling and cancel the tasks still running (their processes are killed)."""
        self._stopping = True
        await self._cancel_all()

    async def _cancel_all(self) -> None:
        pending = [t for t in (self._loop_task, *self._running.values()) if t is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._running.clear()
