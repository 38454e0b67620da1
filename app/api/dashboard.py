"""The web dashboard at ``/``: one HTML page and its static files, plus
``GET /api/v1/whoami`` so the page knows which buttons the token may use.

The page is plain HTML and JavaScript that calls the REST API with the
operator's token; nothing is rendered on the server and nothing is fetched
from anywhere but this server (the Content-Security-Policy says so too).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException, status
from fastapi.responses import FileResponse
from pydantic import BaseModel

from app.api.deps import ROLE_GRANTS, PrincipalDep

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "dashboard"

# Only these files are served: a fixed list leaves no path to traverse.
STATIC_FILES = {
    "app.js": "text/javascript",
    "style.css": "text/css",
}

# Everything comes from this origin; the page has no inline script or style.
CSP = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none';"
    " frame-ancestors 'none'; form-action 'self'"
)
# The page and its files change with the server version; always revalidate.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter()


class WhoAmI(BaseModel):
    """The caller as the server sees it."""

    role: str
    name: str
    grants: list[str]


@router.get("/api/v1/whoami", response_model=WhoAmI, tags=["tokens"])
async def whoami(principal: PrincipalDep) -> WhoAmI:
    """The role and name behind the bearer token, and what that role may do."""
    return WhoAmI(
        role=principal.role, name=principal.name, grants=sorted(ROLE_GRANTS[principal.role])
    )


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    """The dashboard page."""
    return FileResponse(
        DASHBOARD_DIR / "index.html",
        media_type="text/html",
        headers={**HEADERS, "Content-Security-Policy": CSP},
    )


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> FileResponse:
    """One of the dashboard's script and style files."""
    media_type = STATIC_FILES.get(name)
    if media_type is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no static file {name!r}")
    return FileResponse(DASHBOARD_DIR / name, media_type=media_type, headers=HEADERS)
