"""The live KV-cache map: ``GET /kv`` (an HTML page) and ``GET /kv/state`` (JSON).

``/kv/state?engine=i`` is :meth:`LLMEngine.kv_cache_snapshot` of replica i, taken on the engine thread between
two steps, behind the API key. ``/kv`` is one self-contained page that polls it (``?interval=`` seconds); it holds
no data, so it is served without the key and sends the one in its URL fragment (``/kv#key=...``) as a Bearer token.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse, JSONResponse, Response

from pagedllm.engine.async_engine import EngineDeadError
from pagedllm.entrypoints.openai.errors import error_response
from pagedllm.entrypoints.openai.openapi import errors

KV_PAGE_PATH = "/kv"
KV_STATE_PATH = "/kv/state"


@lru_cache(maxsize=1)
def kv_map_html() -> str:
    """The page's source, shipped in the package (``static/kv_map.html``)."""
    return resources.files("pagedllm.entrypoints.openai").joinpath("static/kv_map.html").read_text("utf-8")


def add_kv_map_routes(app: FastAPI, engine: Any, model_name: str, *, requires_api_key: bool = False) -> None:
    """Add ``GET /kv`` and ``GET /kv/state`` to ``app``, reading ``engine`` (an AsyncLLMEngine);
    ``model_name`` (the served name) labels the page. ``requires_api_key``: the server checks an
    API key on ``/kv/state``, so its document lists the 401 (and only then)."""

    @app.get(KV_PAGE_PATH, include_in_schema=False)
    async def kv_page() -> Response:
        return HTMLResponse(kv_map_html(), headers={"Cache-Control": "no-store"})

    last_engine = getattr(engine, "data_parallel_size", 1) - 1  # the document states the range

    @app.get(KV_STATE_PATH, responses={200: {"description": "a snapshot of the KV cache (JSON object)"},
                                       **errors(400, *((401,) if requires_api_key else ()), 404)})
    async def kv_state(engine_index: int = Query(0, alias="engine", ge=0, le=last_engine,
                                                 description="the data-parallel replica")) -> Response:
        try:
            snapshot = await engine.kv_cache_snapshot(engine_index)
        except ValueError as e:
            return error_response(400, str(e), "engine")
        except EngineDeadError as e:
            return error_response(503, str(e))
        except AttributeError:
            return error_response(404, "this engine has no KV cache to show")
        body = snapshot.to_dict()
        body["model"] = model_name
        body["engine"] = engine_index
        return JSONResponse(body, headers={"Cache-Control": "no-store"})
