"""Open Inference Protocol v2 (KServe v2 / Triton HTTP): health, server and model metadata, infer."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from api import __version__
from api.body import read_body
from api.deps import NodeDep, NodeLike, model_version, run_inference
from api.errors import ApiError
from api.tensors import DATATYPES, datatype_of, encode_response, metadata_shape, parse_infer_request

__all__ = ["router"]

router = APIRouter(prefix="/v2", tags=["oip-v2"])

# Version "0" of a node's model is the parameters its image shipped: a node answers it next to its
# current version (the boot health check compares it with the image's reference output, which a
# node that has trained since no longer gives on its current version).
SHIPPED_VERSION = "0"

_ERROR = {"content": {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}}}}
_TENSOR_SCHEMA = {
    "type": "object",
    "required": ["name", "shape", "datatype", "data"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "datatype": {"type": "string", "enum": sorted(DATATYPES)},
        "parameters": {"type": "object"},
        "data": {"type": "array"},
    },
}
_INFER_BODY = {
    "required": True,
    "content": {"application/json": {"schema": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object"},
            "inputs": {"type": "array", "items": _TENSOR_SCHEMA},
            "outputs": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "parameters": {"type": "object"}}}},
        },
    }}},
}
_ERRORS: dict[int | str, dict[str, Any]] = {400: _ERROR, 404: _ERROR, 413: _ERROR}


def _check_model(node: NodeLike, name: str, version: str | None = None) -> None:
    if name != node.model_name:
        raise ApiError(404, f"unknown model '{name}' (this node serves '{node.model_name}')")
    if version is not None and version not in (model_version(node), SHIPPED_VERSION):
        raise ApiError(404, f"model '{name}' has no version '{version}' (serving {model_version(node)}, "
                            f"and {SHIPPED_VERSION}: the image's own parameters)")




# Registered first: the router tries routes in order and infer is the hot path.
def _run_infer(node: NodeLike, name: str, body: bytes, header_length: str | None,
               version: str | None = None) -> tuple[bytes, int | None]:
    # Decode, run and encode in ONE worker-thread hop: the event loop only moves bytes.
    req = parse_infer_request(body, [s.name for s in node.outputs], header_length, node.config.max_batch)
    if version == SHIPPED_VERSION and model_version(node) != SHIPPED_VERSION:
        return encode_response(node.model_name, SHIPPED_VERSION, req, node.infer(req.inputs, shipped=True))
    results = node.infer(req.inputs)
    return encode_response(node.model_name, model_version(node), req, results)


@router.post("/models/{name}/infer", summary="Inference", openapi_extra={"requestBody": _INFER_BODY},
             responses=_ERRORS)
async def infer(name: str, request: Request, node: NodeDep) -> Response:
    """OIP v2 JSON tensors (flat or nested ``data``) or Triton binary tensor data."""
    return await _infer(request, node, name, None)


# A separate route rather than an optional ``version`` parameter: every declared parameter costs
# FastAPI's resolver ~10 us per request (measured), on the hottest path of the node.
@router.post("/models/{name}/versions/{version}/infer", summary="Inference (versioned)",
             openapi_extra={"requestBody": _INFER_BODY}, responses=_ERRORS)
async def infer_versioned(name: str, version: str, request: Request, node: NodeDep) -> Response:
    """Same as ``/v2/models/{name}/infer`` for an explicit model version."""
    return await _infer(request, node, name, version)


async def _infer(request: Request, node: NodeLike, name: str, version: str | None) -> Response:
    _check_model(node, name, version)
    body = await read_body(request)
    out, header_len = await run_inference(request, _run_infer, node, name, body,
                                          request.headers.get("inference-header-content-length"), version)
    if header_len is None:
        return Response(out, media_type="application/json")
    return Response(out, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(header_len)})


@router.get("/health/live", summary="Server liveness")
async def live() -> dict[str, bool]:
    """200 while the process serves HTTP."""
    return {"live": True}


@router.get("/health/ready", summary="Server readiness", responses={503: _ERROR})
async def ready(node: NodeDep) -> Response:
    """200 when the node can answer inference; 503 naming why not (not started, parameters
    being swapped, sample store unavailable)."""
    why = node.readiness()
    if why is not None:
        raise ApiError(503, f"not ready: {why}")
    boot_id = node.config.boot_id  # set when `fractal boot` started this node (firmware/health.py)
    headers = {"Fractal-Boot-Id": boot_id} if boot_id else None
    return Response(b'{"ready":true}', media_type="application/json", headers=headers)


@router.get("", summary="Server metadata")
async def server_metadata() -> dict[str, Any]:
    """Name, version and the protocol extensions this server implements."""
    return {"name": "fractal-edge", "version": __version__, "extensions": ["binary_tensor_data"]}


def _tensor_meta(specs: Any, batched: bool) -> list[dict[str, Any]]:
    return [{"name": s.name, "datatype": datatype_of(s.dtype),
             "shape": metadata_shape(s.shape, batched=batched)} for s in specs]


@router.get("/models/{name}", summary="Model metadata", responses=_ERRORS)
@router.get("/models/{name}/versions/{version}", summary="Model metadata (versioned)", responses=_ERRORS)
async def model_metadata(name: str, node: NodeDep, version: str | None = None) -> dict[str, Any]:
    """Inputs and outputs with OIP datatypes; the batch dimension is -1 (any N >= 1), a model
    without one (inputs with different leading dimensions) reports its exact shapes."""
    _check_model(node, name, version)
    return {"name": node.model_name, "versions": [model_version(node)], "platform": "tvm",
            "inputs": _tensor_meta(node.inputs, node.batched),
            "outputs": _tensor_meta(node.outputs, node.batched)}


@router.get("/models/{name}/ready", summary="Model readiness", responses=_ERRORS)
@router.get("/models/{name}/versions/{version}/ready", summary="Model readiness (versioned)",
            responses=_ERRORS)
async def model_ready(name: str, node: NodeDep, version: str | None = None) -> Response:
    """200 if the model is ready; 400 if loaded but not ready (as Triton does)."""
    _check_model(node, name, version)
    why = node.readiness()
    if why is not None:
        raise ApiError(400, f"model '{name}' is not ready: {why}")
    boot_id = node.config.boot_id  # set when `fractal boot` started this node (firmware/health.py)
    headers = {"Fractal-Boot-Id": boot_id} if boot_id else None
    return Response(b'{"ready":true}', media_type="application/json", headers=headers)
