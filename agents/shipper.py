"""Ship batches to the backend: spool first, then send in seq order, retry until acknowledged.

What the backend answers decides what happens to a batch:

* 200: delivered (or ``duplicate``: delivered before); removed from the spool.
* 401: our node token is unknown: register again with the bootstrap token, then retry.
* 403: the token belongs to another node (say, a state folder reused under a new
  node id): register again as this node, then retry.
* 409, 429, 5xx, connection errors, timeouts: the backend is away or busy: keep the
  batch and retry with exponential backoff and full jitter.
* 404, 405, 407, 408, 421, 425: the endpoint or the connection is at fault, not the
  batch (a wrong server URL would otherwise reject every batch): retry as above.
* any other 4xx (400, 413, 422, ...): the batch itself is malformed and resending
  cannot help: it moves to the spool's ``rejected/`` folder, logged at ERROR.

Ingest is idempotent on (node, seq), so resending a batch whose acknowledgement was
lost stores nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gzip
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from agents.protocol import Batch, IngestAck, Pinglist, RegisterRequest, RegisterResponse
from agents.spool import Spool, write_atomically

log = logging.getLogger(__name__)

GZIP_MIN_BYTES = 4096
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
# Statuses that say nothing about the batch: keep it and retry.
_TRANSIENT_4XX = frozenset({404, 405, 407, 408, 409, 421, 425, 429})
_REAUTH = frozenset({401, 403})


class _Outcome(enum.Enum):
    DELIVERED = "delivered"
    REJECTED = "rejected"
    GONE = "gone"  # dropped from the spool while in flight
    RETRY = "retry"


@dataclass
class ShipperStats:
    """Counters a user or a test reads to see what the shipper did."""

    delivered: int = 0
    duplicates: int = 0  # deliveries the backend already had (a lost acknowledgement)
    rejected: int = 0
    failures: int = 0  # failed send or register attempts, each followed by a backoff
    registrations: int = 0


class RegistrationError(Exception):
    """Registration is not possible now (no bootstrap token, refused, backend away)."""


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2**attempt))."""
    return rng.uniform(0.0, min(cap, base * (2 ** min(attempt, 62))))


class Shipper:
    """Sends spooled batches to ``{server}/api/v1/ingest``, oldest first, exactly once.

    ``submit`` writes a batch to the spool and wakes the sender; ``run`` is the
    sender loop; ``flush`` sends what is queued once (the final flush at shutdown).
    The node token lives in ``token_path`` (when given) so a restart does not
    register again; without a token the shipper registers with the bootstrap token.
    """

    def __init__(
        self,
        server: str,
        node: str,
        spool: Spool,
        client: httpx.AsyncClient,
        *,
        bootstrap_token: str | None = None,
        registration: RegisterRequest | None = None,
        token: str | None = None,
        token_path: Path | None = None,
        gzip_min_bytes: int = GZIP_MIN_BYTES,
        batches_per_cycle: int = 64,
        backoff_base: float = BACKOFF_BASE_S,
        backoff_cap: float = BACKOFF_CAP_S,
        request_timeout: float = 10.0,
        rng: random.Random | None = None,
    ) -> None:
        self.server = server.rstrip("/")
        self.node = node
        self.spool = spool
        self.client = client
        self.bootstrap_token = bootstrap_token
        self.registration = registration
        self.token_path = token_path
        self.gzip_min_bytes = gzip_min_bytes
        self.batches_per_cycle = batches_per_cycle
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.request_timeout = request_timeout
        self.stats = ShipperStats()
        self._rng = rng or random.Random()
        self._token = token if token is not None else self._load_token()
        self._wake = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._register_lock = asyncio.Lock()
        self._attempt = 0  # consecutive failures, for the backoff
        self._retry_after: float | None = None

    # -- token ------------------------------------------------------------------------------

    @property
    def token(self) -> str | None:
        return self._token

    def _load_token(self) -> str | None:
        if self.token_path is None:
            return None
        try:
            saved = json.loads(self.token_path.read_bytes())
        except FileNotFoundError:
            return None
        except (ValueError, OSError) as exc:
            log.warning("token file %s unreadable (%s); registering again", self.token_path, exc)
            return None
        if not isinstance(saved, dict) or saved.get("node") != self.node:
            # A token of another node id would only earn 403s.
            return None
        token = saved.get("token")
        return token if isinstance(token, str) and token else None

    def _save_token(self, token: str) -> None:
        if self.token_path is None:
            return
        self.token_path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps({"node": self.node, "token": token}).encode()
        write_atomically(self.token_path, data, mode=0o600)

    def _registration_request(self) -> RegisterRequest:
        if self.registration is not None:
            return self.registration
        return RegisterRequest(node=self.node, hostname=self.node, address="127.0.0.1")

    async def register(self) -> str:
        """Register this node with the bootstrap token; store and return the new node token.

        Raises ``RegistrationError`` when it cannot (no bootstrap token, refused, backend away).
        """
        async with self._register_lock:
            return await self._register_locked()

    async def _register_locked(self) -> str:
        if not self.bootstrap_token:
            raise RegistrationError(
                "no node token and no bootstrap token: set MESHWATCH_BOOTSTRAP_TOKEN"
            )
        body = self._registration_request().model_dump_json().encode()
        try:
            response = await self.client.post(
                f"{self.server}/api/v1/nodes/register",
                content=body,
                headers={
                    "Authorization": f"Bearer {self.bootstrap_token}",
                    "Content-Type": "application/json",
                },
                timeout=self.request_timeout,
            )
        except httpx.HTTPError as exc:
            raise RegistrationError(f"backend unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise RegistrationError(
                f"registration refused: HTTP {response.status_code} {response.text[:500]}"
            )
        try:
            answer = RegisterResponse.model_validate_json(response.content)
        except ValueError as exc:
            raise RegistrationError(f"registration answer unreadable: {exc}") from exc
        self._token = answer.token
        await asyncio.to_thread(self._save_token, answer.token)
        self.stats.registrations += 1
        log.info("registered node %s with %s", self.node, self.server)
        return answer.token

    async def _current_token(self) -> str:
        """The node token, registering first when there is none."""
        token = self._token
        if token:
            return token
        async with self._register_lock:
            # Another task may have registered while this one waited: one registration only,
            # since each new registration revokes the token before it.
            return self._token or await self._register_locked()

    def _forget_token(self, used: str) -> None:
        """Drop a token the backend refused, unless a newer one already replaced it."""
        if self._token == used:
            self._token = None

    # Other clients of the backend on this node (the task runner) share the token.
    current_token = _current_token
    forget_token = _forget_token

    # -- queueing ---------------------------------------------------------------------------

    def encode(self, batch: Batch) -> bytes:
        return batch.model_dump_json().encode()

    async def submit(self, batch: Batch) -> None:
        """Write ``batch`` durably to the spool and wake the sender."""
        await asyncio.to_thread(self.spool.append, batch.seq, self.encode(batch))
        self._wake.set()

    @property
    def backlog(self) -> int:
        return len(self.spool)

    # -- sending ----------------------------------------------------------------------------

    def _body(self, data: bytes) -> tuple[bytes, dict[str, str]]:
        headers = {"Content-Type": "application/json"}
        if len(data) > self.gzip_min_bytes:
            headers["Content-Encoding"] = "gzip"
            return gzip.compress(data, compresslevel=6), headers
        return data, headers

    async def _post_batch(self, body: bytes, headers: dict[str, str], timeout: float
                          ) -> tuple[httpx.Response, str]:
        token = await self._current_token()
        response = await self.client.post(
            f"{self.server}/api/v1/ingest",
            content=body,
            headers={**headers, "Authorization": f"Bearer {token}"},
            timeout=timeout,
        )
        return response, token

    async def _send_one(self, seq: int, timeout: float) -> _Outcome:
        data = await asyncio.to_thread(self.spool.read, seq)
        if data is None:
            return _Outcome.GONE
        body, headers = self._body(data)
        try:
            response, token = await self._post_batch(body, headers, timeout)
            if response.status_code in _REAUTH:
                log.warning(
                    "ingest answered %d for node %s: registering again",
                    response.status_code, self.node,
                )
                self._forget_token(token)
                response, token = await self._post_batch(body, headers, timeout)
        except RegistrationError as exc:
            log.error("cannot register node %s: %s", self.node, exc)
            return _Outcome.RETRY
        except httpx.HTTPError as exc:
            log.info("backend away (%r); batch seq=%d stays spooled", exc, seq)
            return _Outcome.RETRY

        status = response.status_code
        if status == 200:
            try:
                ack = IngestAck.model_validate_json(response.content)
            except ValueError:
                ack = None
            if ack is not None and ack.seq != seq:
                log.warning("ingest acknowledged seq=%d for batch seq=%d", ack.seq, seq)
            if ack is not None and ack.duplicate:
                self.stats.duplicates += 1
            await asyncio.to_thread(self.spool.remove, seq)
            self.stats.delivered += 1
            return _Outcome.DELIVERED
        if status in _REAUTH:
            log.error("ingest still answers %d after registering again; will retry", status)
            return _Outcome.RETRY
        if 400 <= status < 500 and status not in _TRANSIENT_4XX:
            reason = f"HTTP {status}\n{response.text[:8000]}\n"
            path = await asyncio.to_thread(self.spool.reject, seq, reason)
            self.stats.rejected += 1
            log.error(
                "backend REJECTED batch seq=%d of node %s as malformed (HTTP %d): moved to %s: %s",
                seq, self.node, status, path, response.text[:500],
            )
            return _Outcome.REJECTED
        if status in (429, 503):
            self._retry_after = _retry_after_seconds(response)
        log.info("ingest answered HTTP %d; batch seq=%d stays spooled", status, seq)
        return _Outcome.RETRY

    async def flush(self, max_batches: int | None = None, deadline: float | None = None) -> bool:
        """Send queued batches oldest first until the queue is empty or one fails.

        ``deadline`` is a ``time.monotonic()`` instant after which no new send
        starts and the one in flight is cut short. Returns True when the queue
        was drained, False when a send failed or the limit or deadline came first.
        """
        async with self._send_lock:
            sent = 0
            while True:
                limit = self.batches_per_cycle
                if max_batches is not None:
                    limit = min(limit, max_batches - sent)
                seqs = self.spool.oldest(limit) if limit > 0 else []
                if not seqs:
                    return len(self.spool) == 0
                for seq in seqs:
                    timeout = self.request_timeout
                    if deadline is not None:
                        timeout = min(timeout, deadline - time.monotonic())
                        if timeout <= 0:
                            return False
                    try:
                        # asyncio.timeout, not wait_for: wait_for (3.11) can swallow a
                        # cancellation that lands as the send completes, and the task to
                        # cancel at shutdown would then keep running.
                        async with asyncio.timeout(timeout):
                            outcome = await self._send_one(seq, timeout)
                    except TimeoutError:
                        # Cut short: the batch stays spooled; ingest dedup makes a resend safe.
                        outcome = _Outcome.RETRY
                    if outcome is _Outcome.RETRY:
                        self.stats.failures += 1
                        self._attempt += 1
                        return False
                    self._attempt = 0
                    sent += 1

    async def run(self) -> None:
        """Send forever: wake on a new batch, keep going while a backlog exists, back off on
        failure. Cancel the task to stop; a batch in flight then stays spooled."""
        while True:
            self._wake.clear()
            drained = await self.flush(max_batches=self.batches_per_cycle)
            if self._attempt:
                delay = backoff_delay(self._attempt - 1, self.backoff_base, self.backoff_cap,
                                      self._rng)
                if self._retry_after is not None:
                    delay = max(delay, min(self._retry_after, self.backoff_cap))
                    self._retry_after = None
                log.debug("backing off %.2f s after %d failures", delay, self._attempt)
                # New batches do not cut a backoff short: they wait in the spool.
                await asyncio.sleep(delay)
                continue
            if not drained:
                # A backlog: the next cycle starts now, so catching up outpaces real time.
                await asyncio.sleep(0)
                continue
            await self._wake.wait()

    # -- pinglist ---------------------------------------------------------------------------

    async def fetch_pinglist(self, etag: str | None = None) -> tuple[Pinglist | None, str | None]:
        """GET this node's pinglist. Returns (pinglist, etag), or (None, etag) when unchanged.

        Raises ``httpx.HTTPError`` or ``RegistrationError`` when it cannot be had now.
        """
        url = f"{self.server}/api/v1/pinglist/{self.node}"
        response: httpx.Response | None = None
        for _ in range(2):
            token = await self._current_token()
            headers = {"Authorization": f"Bearer {token}"}
            if etag:
                headers["If-None-Match"] = etag
            response = await self.client.get(url, headers=headers, timeout=self.request_timeout)
            if response.status_code not in _REAUTH:
                break
            self._forget_token(token)
        assert response is not None
        if response.status_code == 304:
            return None, etag
        response.raise_for_status()
        pinglist = Pinglist.model_validate_json(response.content)
        return pinglist, response.headers.get("ETag")


def _retry_after_seconds(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    with contextlib.suppress(ValueError):
        return max(0.0, float(value))
    return None
