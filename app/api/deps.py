"""Shared dependencies of the routes: database session and who is calling.

Roles: ``node`` (an agent: ingest, its pinglist, its tasks), ``read`` (a
scheduler or dashboard reading state), ``isolate`` (read, plus isolate and
release), ``admin`` (everything). A token is sent as ``Authorization: Bearer``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app.settings import Settings
from app.store.models import ApiToken, Node

ROLE_GRANTS: dict[str, set[str]] = {
    "admin": {"admin", "read", "isolate"},
    "isolate": {"read", "isolate"},
    "read": {"read"},
    "node": {"node"},
}


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    role: str
    name: str
    node: str | None = None

    def can(self, grant: str) -> bool:
        return grant in ROLE_GRANTS[self.role]


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessionmaker() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return token.strip()


async def get_principal(request: Request, session: SessionDep) -> Principal:
    token = bearer(request)
    settings: Settings = request.app.state.settings
    if settings.admin_token and hmac.compare_digest(token, settings.admin_token):
        return Principal("admin", "admin")
    digest = hash_token(token)
    node = (await session.execute(select(Node.id).where(Node.token_hash == digest))).scalar()
    if node is not None:
        return Principal("node", node, node=node)
    row = (
        await session.execute(
            select(ApiToken.role, ApiToken.name).where(ApiToken.token_hash == digest)
        )
    ).first()
    if row is not None:
        return Principal(row.role, row.name)
    raise HTTPException(
        status.HTTP_401_UNAUTHORIZED, "unknown token", headers={"WWW-Authenticate": "Bearer"}
    )


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require(grant: str):  # type: ignore[no-untyped-def]
    """A dependency that lets through only principals holding ``grant``."""

    async def check(principal: PrincipalDep) -> Principal:
        if not principal.can(grant):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN, f"role {principal.role!r} may not {grant}"
            )
        return principal

    return Depends(check)


def require_node(principal: Principal, node: str) -> None:
    """Agents act only for their own node."""
    if principal.role != "node":
        raise HTTPException(status.HTTP_403_FORBIDDEN, "a node token is required")
    if principal.node != node:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"this token belongs to node {principal.node!r}"
        )
