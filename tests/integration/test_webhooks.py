"""Alert webhooks end to end: a real server, its outbox in PostgreSQL, and a
real HTTP receiver on 127.0.0.1 that checks what a subscriber would check."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from app.actions.webhooks import sign, verify
from tests.integration.test_isolation import Cluster, Received, Receiver, cluster, wait_for

NO_ENGINE = {"MESHWATCH_RUN_ENGINE": "false"}
SECRET = "whsec-0123456789abcdef0123"


async def subscribe(c: Cluster, url: str, **extra: Any) -> dict[str, Any]:
    r = await c.client.post("/api/v1/webhooks", headers=c.admin,
                            json={"name": "oncall", "url": url, **extra})
    assert r.status_code == 201, r.text
    return r.json()


async def deliveries(c: Cluster, webhook_id: int, **params: Any) -> list[dict[str, Any]]:
    r = await c.client.get(f"/api/v1/webhooks/{webhook_id}/deliveries", headers=c.admin,
                           params=params)
    assert r.status_code == 200, r.text
    return r.json()


async def isolate(c: Cluster, node: str, reason: str = "flapping NIC") -> None:
    r = await c.client.post(f"/api/v1/nodes/{node}/isolate", headers=c.admin,
                            json={"reason": reason})
    assert r.status_code == 200, r.text


def received(receiver: Receiver, n: int):  # type: ignore[no-untyped-def]
    async def probe() -> list[Received] | None:
        got = receiver.events()
        return got if len(got) >= n else None

    return probe


async def test_signed_delivery_retried_after_500(pg_url: str, tmp_path: Path) -> None:
    with Receiver(statuses=[500]) as rx:
        async with cluster(pg_url, tmp_path, **NO_ENGINE) as c:
            await c.register([f"n{i}" for i in range(20)])
            hook = await subscribe(c, rx.url, secret=SECRET)
            assert hook["secret"] == SECRET
            listed = (await c.client.get("/api/v1/webhooks", headers=c.admin)).json()
            assert "secret" not in listed[0]
            await isolate(c, "n4")
            first, second = await wait_for(received(rx, 2), 20, "a retry after the 500")
            # The same delivery twice: same id, fresh signature over timestamp and body.
            key = first.headers["x-meshwatch-delivery"]
            assert second.headers["x-meshwatch-delivery"] == key
            assert first.headers["idempotency-key"] == key
            for req in (first, second):
                ts = req.headers["x-meshwatch-timestamp"]
                assert abs(int(ts) - time.time()) < 60
                sig = req.headers["x-meshwatch-signature"]
                assert sig.startswith("sha256=")
                assert verify(SECRET, ts, req.body, sig)
                assert not verify("another-secret-entirely", ts, req.body, sig)
                assert not verify(SECRET, str(int(ts) + 1), req.body, sig)
                assert not verify(SECRET, ts, req.body.replace(b"n4", b"n5"), sig)
            body = second.json()
            assert body["delivery"] == int(key)
            assert body["event"] == "node.isolated" and body["node"] == "n4"
            assert body["action"]["reason"] == "flapping NIC"
            assert body["action"]["actor"] == "admin"

            async def delivered() -> list[dict[str, Any]]:
                return await deliveries(c, hook["id"], state="delivered")

            rows = await wait_for(delivered, 10, "delivered state")
            assert rows[0]["id"] == int(key)
            assert rows[0]["attempts"] == 2 and rows[0]["last_status"] == 200
            assert rows[0]["payload"]["event"] == "node.isolated"


async def test_dead_letter_visible_and_retried(pg_url: str, tmp_path: Path) -> None:
    with Receiver(statuses=[500, 503, 500]) as rx:
        async with cluster(pg_url, tmp_path, MESHWATCH_WEBHOOK_MAX_ATTEMPTS="3",
                           **NO_ENGINE) as c:
            await c.register([f"n{i}" for i in range(20)])
            hook = await subscribe(c, rx.url)
            await isolate(c, "n1")

            async def dead() -> list[dict[str, Any]]:
                return await deliveries(c, hook["id"], state="dead")

            rows = await wait_for(dead, 20, "a dead letter")
            assert rows[0]["attempts"] == 3 and rows[0]["last_status"] == 500
            assert rows[0]["last_error"].startswith("HTTP 500")
            assert len(rx.events()) == 3
            r = await c.client.post(
                f"/api/v1/webhooks/{hook['id']}/deliveries/{rows[0]['id']}/retry",
                headers=c.admin)
            assert r.status_code == 200, r.text

            async def delivered() -> list[dict[str, Any]]:
                return await deliveries(c, hook["id"], state="delivered")

            await wait_for(delivered, 20, "delivered after the retry")
            keys = {e.headers["x-meshwatch-delivery"] for e in rx.events()}
            assert keys == {str(rows[0]["id"])}


async def test_no_duplicate_after_restart_mid_delivery(pg_url: str, tmp_path: Path) -> None:
    """The server dies while the receiver holds a delivery open: after restart the
    same row is sent again under the same delivery id, once, and nothing else is."""
    with Receiver() as rx:
        async with cluster(pg_url, tmp_path, **NO_ENGINE) as c:
            await c.register([f"n{i}" for i in range(20)])
            hook = await subscribe(c, rx.url, secret=SECRET)
            rx.hold = True
            await isolate(c, "n2")
            assert await asyncio.to_thread(rx.held.wait, 20), "first attempt never arrived"
            c.kill()
            rx.release()  # the crashed sender never reads this answer
            await asyncio.to_thread(c.backend.start)
            # A second event after the restart: once it is delivered, the first
            # has been dealt with too (rows go out in id order).
            r = await c.client.post("/api/v1/nodes/n2/release", headers=c.admin,
                                    json={"reason": "false alarm"})
            assert r.status_code == 200, r.text

            async def both_delivered() -> list[dict[str, Any]] | None:
                rows = await deliveries(c, hook["id"])
                return rows if len(rows) == 2 and all(
                    d["state"] == "delivered" for d in rows) else None

            rows = await wait_for(both_delivered, 30, "both deliveries delivered")
            by_key: dict[str, list[Received]] = {}
            for e in rx.events():
                by_key.setdefault(e.headers["x-meshwatch-delivery"], []).append(e)
            first_id = str(min(d["id"] for d in rows))
            second_id = str(max(d["id"] for d in rows))
            assert set(by_key) == {first_id, second_id}
            # At least once: the interrupted attempt and its redelivery, same id
            # and same body; a receiver deduplicating on the id acts once.
            assert len(by_key[first_id]) == 2
            assert by_key[first_id][0].body == by_key[first_id][1].body
            assert len(by_key[second_id]) == 1
            assert [json.loads(e.body)["event"] for e in rx.events()] == [
                "node.isolated", "node.isolated", "node.released"]


async def test_filters_and_slack_format(pg_url: str, tmp_path: Path) -> None:
    with Receiver() as slack, Receiver() as pager:
        async with cluster(pg_url, tmp_path, **NO_ENGINE) as c:
            await c.register([f"n{i}" for i in range(20)])
            s = await subscribe(c, slack.url, format="slack", kinds=["node-released"])
            p = await subscribe(c, pager.url, min_severity="critical")
            await isolate(c, "n7")
            r = await c.client.post("/api/v1/nodes/n7/release", headers=c.admin,
                                    json={"reason": "cleared"})
            assert r.status_code == 200
            # Outbox rows are written with the change: the filters decided already.
            assert await deliveries(c, p["id"]) == []
            rows = await deliveries(c, s["id"])
            assert [d["event"] for d in rows] == ["node.released"]
            (msg,) = await wait_for(received(slack, 1), 20, "the slack message")
            assert msg.json() == {"text": "node.released: node n7\naction: released (cleared)"}
            assert "x-meshwatch-signature" not in msg.headers


def test_signature_is_hmac_sha256_of_timestamp_dot_body() -> None:
    """The documented scheme, computed independently."""
    import hashlib
    import hmac

    body = b'{"event":"incident.opened"}'
    expected = hmac.new(b"k" * 16, b"1700000000." + body, hashlib.sha256).hexdigest()
    assert sign("k" * 16, "1700000000", body) == "sha256=" + expected
