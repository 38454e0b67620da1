"""API tokens for schedulers, dashboards and people (admin only).

A token is shown once, when created; only its SHA-256 is stored. Roles:
``read`` (state), ``isolate`` (read, plus isolate and release), ``admin``.
Node tokens are issued by enrolment, not here.
"""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Literal

from fastapi import APIRouter, HTTPException, Response, status
from pydantic import BaseModel, Field
from sqlalchemy import delete, select, text

from app.api.deps import Principal, SessionDep, hash_token, require
from app.store.models import ApiToken

router = APIRouter(prefix="/api/v1/tokens", tags=["tokens"])


class TokenCreate(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    role: Literal["read", "isolate", "admin"]


class TokenOut(BaseModel):
    id: int
    name: str
    role: str
    created_at: datetime


class TokenCreated(TokenOut):
    token: str = Field(description="shown only in this response")


@router.post("", response_model=TokenCreated, status_code=status.HTTP_201_CREATED)
async def create_token(
    body: TokenCreate, session: SessionDep, principal: Principal = require("admin")
) -> TokenCreated:
    """Create a token; the secret is returned once and stored only as a hash."""
    token = secrets.token_urlsafe(32)
    row = (
        await session.execute(
            text(
                "INSERT INTO api_tokens (name, role, token_hash) VALUES (:name, :role, :hash)"
                " RETURNING id, name, role, created_at"
            ),
            {"name": body.name, "role": body.role, "hash": hash_token(token)},
        )
    ).one()
    await session.commit()
    return TokenCreated(**row._mapping, token=token)


@router.get("", response_model=list[TokenOut])
async def list_tokens(
    session: SessionDep, principal: Principal = require("admin")
) -> list[ApiToken]:
    """List tokens (never their secrets)."""
    return list((await session.execute(select(ApiToken).order_by(ApiToken.id))).scalars())


@router.delete("/{token_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_token(
    token_id: int, session: SessionDep, principal: Principal = require("admin")
) -> Response:
    """Revoke a token; it stops working at once."""
    result = await session.execute(delete(ApiToken).where(ApiToken.id == token_id))
    if result.rowcount == 0:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no token {token_id}")
    await session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
