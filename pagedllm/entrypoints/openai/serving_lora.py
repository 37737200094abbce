"""LoRA adapters over HTTP: a request's ``model`` naming an adapter, ``GET /v1/models`` listing them with
their ``parent``, and vLLM's ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (only with
``allow_runtime_lora_updating``: the client names a path, read only under ``lora_allowed_dirs``)."""

from __future__ import annotations

import os
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.request import LoRAError, LoRAInUseError, LoRARequest
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.sampling_params import SamplingParams


def lora_registry(engine) -> LoRARegistry | None:
    """The engine's adapters by name (read from the loop; changed only on the engine thread). Replicas
    (data parallelism) each number ``lora_modules`` alike from 1, so the front end rebuilds that list."""
    if not engine.config.enable_lora:
        return None
    registry = getattr(getattr(engine, "engine", None), "lora_registry", None)
    if registry is not None:
        return registry
    registry = LoRARegistry()
    for name, path in engine.config.lora_module_paths().items():
        registry.add(registry.new_request(name, path))
    return registry


def adapter_named(registry: LoRARegistry | None, model: str | None) -> LoRARequest | None:
    return None if registry is None or model is None else registry.get(model)


def with_adapter(params: SamplingParams, lora_request: LoRARequest | None) -> SamplingParams:
    """``params`` running under ``lora_request`` (unchanged for the base model)."""
    return params if lora_request is None else replace(params, lora_request=lora_request)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def check_allowed_path(path: str, allowed_dirs: list[str]) -> str:
    """The resolved ``path`` when it lies under one of ``allowed_dirs`` (symbolic links followed), else 400."""
    real = os.path.realpath(path)
    for folder in allowed_dirs:
        root = os.path.realpath(folder)
        if os.path.commonpath([real, root]) == root:
            return real
    raise APIError(400, f"lora_path {path!r} is outside the folders the server allows (--lora-allowed-dirs)",
                   "lora_path")


def lora_admin_router() -> APIRouter:
    """The load and unload routes (added by ``build_app`` only when run-time updating is allowed)."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
        engine = raw_request.app.state.engine
        _require_single_engine(engine)
        path = check_allowed_path(body.lora_path, engine.config.lora_allowed_dirs or [])

        def load(e):
            if body.load_inplace and e.lora_registry.get(body.lora_name) is not None:
                e.remove_lora(body.lora_name)
            return e.add_lora(e.lora_registry.new_request(body.lora_name, path))

        try:
            await engine.call(load)
        except LoRAInUseError as e:
            raise APIError(409, str(e), "lora_name") from None
        except LoRAError as e:
            raise APIError(400, str(e), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
        engine = raw_request.app.state.engine
        _require_single_engine(engine)
        try:
            await engine.call(lambda e: e.remove_lora(body.lora_name))
        except LoRAInUseError as e:
            raise APIError(409, str(e), "lora_name") from None
        except LoRAError as e:
            raise APIError(404 if "no adapter named" in str(e) else 400, str(e), "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router


def _require_single_engine(engine) -> None:
    if getattr(getattr(engine, "engine", None), "lora_registry", None) is None:
        raise APIError(400, "loading adapters at run time is not supported with data_parallel_size > 1; "
                            "give them as --lora-modules")
