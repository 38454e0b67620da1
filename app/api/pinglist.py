"""``GET /api/v1/pinglist/{node}``: whom a node's agent probes.

Computed from the topology the backend knows (node -> ToR -> pod): full mesh
inside a ToR, a rotating bounded sample across ToRs (``app.analysis.topology``).
The ETag changes when membership or addresses change, or the hourly rotation
moves on; agents poll with If-None-Match and get 304 otherwise.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, HTTPException, Request, Response, status

from agents.protocol import Peer, Pinglist
from app.analysis.detectors import load_topology
from app.analysis.topology import pinglist_for, pinglist_version
from app.api.deps import PrincipalDep, SessionDep, SettingsDep

router = APIRouter(prefix="/api/v1/pinglist", tags=["pinglist"])

ROTATION_S = 3600


@router.get("/{node}", response_model=Pinglist, responses={304: {"description": "unchanged"}})
async def get_pinglist(
    node: str,
    request: Request,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
    principal: PrincipalDep,
) -> Pinglist | Response:
    """The peers this node probes, with their probe addresses; ETag / 304 aware."""
    if not (principal.node == node or principal.can("read")):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "a node reads only its own pinglist")
    topology = await load_topology(await session.connection())
    if node not in topology:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"node {node!r} is not registered")
    names = pinglist_for(topology, node, settings.cross_tor_peers, int(time.time()) // ROTATION_S)
    peers = [
        Peer(node=n, address=topology.nodes[n].address, port=topology.nodes[n].port) for n in names
    ]
    version = pinglist_version(f"{p.node}@{p.address}:{p.port}" for p in peers)
    etag = f'"{version}"'
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
    response.headers["ETag"] = etag
    return Pinglist(node=node, version=version, peers=peers)
