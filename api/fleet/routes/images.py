"""The image catalogue: POST /api/images (verified on upload), GET /api/images, GET /api/images/{id}
(range requests, so a node's download resumes after a cut; the operator token or a node's
download grant from an ImageUpdateCommand)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import FileResponse

from api.fleet.auth import Authenticated, check_token, token_from
from api.fleet.deps import Service
from api.fleet.images import GrantRefused, ImageCatalogue, UploadTooLarge
from firmware.errors import FirmwareError

router = APIRouter(prefix="/api", tags=["images"])


def get_catalogue(request: Request) -> ImageCatalogue:
    cat: ImageCatalogue | None = request.app.state.fleet.images
    if cat is None:
        raise HTTPException(404, "this fleet has no image catalogue (start it with an images directory)")
    return cat


Catalogue = Annotated[ImageCatalogue, Depends(get_catalogue)]


@router.post("/images", status_code=201)
async def upload_image(request: Request, _: Authenticated, cat: Catalogue, fleet: Service) -> dict:
    """Upload a device image (raw body); 400 when it does not verify with the fleet's keys."""
    try:
        entry = await cat.add(request.stream())
        fleet.image_uploaded()
        return entry
    except UploadTooLarge as exc:
        raise HTTPException(413, str(exc)) from None
    except FirmwareError as exc:
        raise HTTPException(400, f"{exc} (help: {exc.hint})" if exc.hint else str(exc)) from None


@router.get("/images")
def list_images(_: Authenticated, cat: Catalogue) -> dict:
    return {"images": cat.list()}


@router.get("/images/{image_id}")
def get_image(image_id: str, request: Request, cat: Catalogue, fleet: Service) -> FileResponse:
    """The image file: with the operator token, or a node's download grant (and, in a signed
    swarm, the node's proof); 400 for a malformed grant, 401/403 for one that does not open it."""
    if not check_token(request, token_from(request)):
        try:
            fleet.check_download(image_id, dict(request.query_params))
        except GrantRefused as exc:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
            raise HTTPException(exc.status, exc.reason, headers=headers) from None
    path = cat.path(image_id)
    if path is None:
        raise HTTPException(404, f"unknown image {image_id!r}")
    return FileResponse(path, media_type="application/octet-stream")
