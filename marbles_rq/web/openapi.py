"""The HTTP API's route table (its row type) and the OpenAPI 3.1 document made from it.

The schemas come from the msgspec Structs the handlers decode and encode
(`msgspec.json.schema_components`), the paths from the same table Starlette's routes are
made from (web/routes_api.ROUTES), so the document cannot describe an API that is not there.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from .. import __version__
from .api_errors import STATUS
from .api_models import ErrorBody

REF = "#/components/schemas/{name}"
# Every route may answer these, whatever it does.
COMMON_REFUSALS = ("unauthorized", "api_disabled", "forbidden", "throttled",
                   "redis_unavailable", "internal")


@dataclass(frozen=True)
class Param:
    """A query parameter."""

    name: str
    type: str  # integer | number | string
    doc: str


@dataclass(frozen=True)
class ApiRoute:
    method: str
    path: str  # the full path, /api/...
    handler: Callable[[Any, Request], Awaitable[Response]]  # an Api method
    summary: str
    body: type | None = None  # the request body's Struct
    reply: type | None = None  # the success body's Struct
    status: tuple[int, ...] = (200,)  # success statuses
    query: tuple[Param, ...] = ()
    refusals: tuple[str, ...] = ()  # error codes it may answer besides COMMON_REFUSALS
    stream: bool = False  # a text/event-stream, each event's data a `reply`
    open: bool = False  # needs no token
    raw: str = ""  # the body (sent or answered) is raw bytes of this media type, not JSON


def document(routes: Sequence[ApiRoute]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `routes`."""
    models: list[Any] = [ErrorBody]
    for route in routes:
        models += [m for m in (route.body, route.reply) if m is not None and m not in models]
    refs, components = msgspec.json.schema_components(models, ref_template=REF)
    ref_of = dict(zip(models, refs, strict=True))
    error = {"description": "refused", "content": {"application/json": {
        "schema": ref_of[ErrorBody]}}}
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        op: dict[str, Any] = {
            "operationId": route.handler.__name__,
            "summary": route.summary,
            "parameters": [
                *({"name": name, "in": "path", "required": True,
                   "schema": {"type": "string"}}
                  for name in re.findall(r"\{(\w+)\}", route.path)),
                *({"name": p.name, "in": "query", "required": False, "description": p.doc,
                   "schema": {"type": p.type}} for p in route.query)],
            "responses": {},
        }
        if route.open:
            op["security"] = []
        if route.body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": ref_of[route.body]}}}
        elif route.raw and route.method in ("PUT", "POST"):
            op["requestBody"] = {"required": True, "content": {route.raw: {
                "schema": {"type": "string", "format": "binary"}}}}
        kind = "text/event-stream" if route.stream else "application/json"
        if route.raw and route.method == "GET":  # the raw bytes are the answer
            op["responses"]["200"] = {"description": route.summary, "content": {route.raw: {
                "schema": {"type": "string", "format": "binary"}}}}
            route_status: tuple[int, ...] = ()
        else:
            route_status = route.status
        for status in route_status:
            op["responses"][str(status)] = {
                "description": route.summary if status == route.status[0] else "see summary",
                "content": {kind: {"schema": ref_of[route.reply] if route.reply is not None
                                   else {"type": "object"}}}}
        codes = route.refusals + (() if route.open else COMMON_REFUSALS)
        for code in codes:
            status_text = str(STATUS[code])
            entry = op["responses"].setdefault(status_text, {**error, "x-codes": []})
            entry["x-codes"].append(code)
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "marbles-rq HTTP API", "version": __version__,
                 "description": "JSON endpoints of `marbles-rq web`. Every refusal is one "
                                "object {\"error\": {\"code\", \"message\"}}; `x-codes` lists "
                                "the codes a status stands for."},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "MARBLES_API_TOKEN"}}},
        "security": [{"bearer": []}],
    }
