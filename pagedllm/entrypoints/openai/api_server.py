"""The OpenAI-compatible HTTP server: ``pagedllm serve [MODEL] --host --port --api-key ...``.

Endpoints: ``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` (with ``GET``/``DELETE
/v1/responses/{id}`` and ``POST .../cancel``), Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens``,
``GET /v1/models[/{model}]``, ``/health``, ``/version``, ``POST /tokenize``, ``/detokenize``, ``GET /metrics``,
``GET /kv`` and ``/kv/state`` (off with ``--disable-kv-map``), ``GET /openapi.json``. The routes are functions on
:data:`router` reading ``request.app.state``; :func:`build_app` assembles. The error contract, limits and shutdown
are in ``docs/architecture.md`` ("The HTTP server"), the Responses and Messages APIs in ``docs/api.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hmac
import logging
import socket
import sys
from typing import Any, Awaitable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm import envs
from pagedllm.config import DEFAULT_MODEL
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineUnhealthyError
from pagedllm.entrypoints.openai.errors import (
    APIError, error_response, is_anthropic_path, to_api_error, validation_message)
from pagedllm.entrypoints.openai.kv_map import KV_PAGE_PATH, add_kv_map_routes
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, DetokenizeRequest,
    DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse, VersionResponse)
from pagedllm.entrypoints.openai.protocol_messages import (
    AnthropicErrorResponse, CountTokensRequest, CountTokensResponse, MessagesRequest, MessagesResponse)
from pagedllm.entrypoints.openai.protocol_responses import ResponseObject, ResponsesRequest
from pagedllm.entrypoints.openai.openapi import errors, finish_document, json_or_sse
from pagedllm.entrypoints.openai.lifecycle import DrainingServer, InFlight, InFlightMiddleware
from pagedllm.entrypoints.openai.response_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_COUNT, ResponseStore
from pagedllm.entrypoints.openai.serving_base import ClientDisconnected, json_response, until_disconnected
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_lora import lora_admin_router
from pagedllm.entrypoints.openai.serving_messages import ServingMessages
from pagedllm.entrypoints.openai.serving_responses import ServingResponses
from pagedllm.entrypoints.openai.serving_pooling import pooling_router
from pagedllm.entrypoints.openai.tenant_salt import ISOLATION_MODES, reset_tenant, set_tenant
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from pagedllm.metrics import CONTENT_TYPE_LATEST

logger = logging.getLogger("pagedllm.server")

_OPEN_PATHS = ("/health", "/metrics", "/version", "/openapi.json", "/docs", "/redoc")  # probes, scrapers, docs
_OPEN_PAGES = (KV_PAGE_PATH,)  # exact paths: pages without data (their data routes need the key)
DEFAULT_MAX_PROMPTS = 1024
# The GIL switch interval of `serve` (ms): shorter than Python's 5 ms so the HTTP loop waits less for
# the engine thread (benchmarks/results/serving_sweep_switch_interval_ms.json).
DEFAULT_SWITCH_INTERVAL_MS = 1.0
_REQUEST_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
_API_ERRORS = (400, 401, 404)  # finish_document drops the 401 when the server has no key
_ANTHROPIC_ERRORS = errors(*_API_ERRORS, 500, model=AnthropicErrorResponse)


class APIKeyMiddleware:
    """Pure-ASGI check (streaming-safe) of ``Authorization: Bearer <key>`` or Anthropic's ``x-api-key``, before
    the body is read; the scheme is case-insensitive (RFC 9110 11.1), each key compared in constant time.
    ``isolate``: the request runs in its key's prefix-cache namespace (``tenant_salt``)."""

    def __init__(self, app: Any, api_keys: list[str], isolate: bool = False) -> None:
        self.app = app
        self.expected = [k.encode() for k in api_keys]
        self.isolate = isolate

    def _matched_key(self, scope: dict) -> bytes | None:
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        sent = [token.strip()] if scheme.lower() == b"bearer" else []
        sent.append(headers.get(b"x-api-key", b"").strip())
        matched = None
        for key in self.expected:  # every comparison runs: the time does not tell which key matched
            for candidate in sent:
                if hmac.compare_digest(candidate, key) and matched is None:
                    matched = key
        return matched

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"].startswith(_OPEN_PATHS) \
                or scope["path"] in _OPEN_PAGES:
            await self.app(scope, receive, send)
            return
        key = self._matched_key(scope)
        if key is None:
            response = error_response(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'"
                                      " or 'x-api-key: <key>'", anthropic=is_anthropic_path(scope["path"]))
            await response(scope, receive, send)
            return
        if not self.isolate:
            await self.app(scope, receive, send)
            return
        token = set_tenant(key)
        try:
            await self.app(scope, receive, send)
        finally:
            reset_tenant(token)


def _error_for(request: Request, err: APIError, headers: dict | None = None) -> JSONResponse:
    return error_response(err.status, err.message, err.param, headers, anthropic=is_anthropic_path(request.url.path))


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return _error_for(request, exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, field = validation_message(exc)
    return _error_for(request, APIError(400, message, field))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _error_for(request, APIError(exc.status_code, str(exc.detail)), exc.headers)  # 405 keeps its Allow


async def _any_error(request: Request, exc: Exception) -> JSONResponse:
    err = to_api_error(exc, _REQUEST_FIELDS)
    if err.status == 500:
        logger.exception("unhandled error", exc_info=exc)
    return _error_for(request, err)


async def run_handler(coro: Awaitable[Response], raw_request: Request) -> Response:
    """Run a handler until done or the client leaves; its exceptions become error responses in
    the route's API shape (never a traceback)."""
    try:
        return await until_disconnected(coro, raw_request)
    except ClientDisconnected:
        logger.info("client disconnected; its request was aborted")
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
    except Exception as e:  # noqa: BLE001
        err = to_api_error(e, _REQUEST_FIELDS)
        if err.status == 500 and not isinstance(e, APIError):
            logger.exception("request failed", exc_info=e)
        return _error_for(raw_request, err)


router = APIRouter()


@router.post("/v1/completions", responses={**json_or_sse(CompletionResponse), **errors(*_API_ERRORS, 500)})
async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
    return await run_handler(raw_request.app.state.completions.create_completion(body), raw_request)


@router.post("/v1/chat/completions", responses={**json_or_sse(ChatCompletionResponse), **errors(*_API_ERRORS, 500)})
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
    return await run_handler(raw_request.app.state.chat.create_chat_completion(body), raw_request)


@router.post("/v1/responses", responses={**json_or_sse(ResponseObject), **errors(*_API_ERRORS, 500)})
async def create_response(body: ResponsesRequest, raw_request: Request) -> Response:
    return await run_handler(raw_request.app.state.responses.create(body), raw_request)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=errors(*_API_ERRORS))
async def retrieve_response(response_id: str, raw_request: Request) -> Response:
    return json_response(raw_request.app.state.responses.retrieve(response_id))


@router.delete("/v1/responses/{response_id}", responses={200: {"description": "deleted"}, **errors(*_API_ERRORS)})
async def delete_response(response_id: str, raw_request: Request) -> Response:
    return JSONResponse(raw_request.app.state.responses.delete(response_id))


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject, responses=errors(*_API_ERRORS))
async def cancel_response(response_id: str, raw_request: Request) -> Response:
    return json_response(await raw_request.app.state.responses.cancel(response_id))


@router.post("/v1/messages", responses={**json_or_sse(MessagesResponse), **_ANTHROPIC_ERRORS})
async def create_message(body: MessagesRequest, raw_request: Request) -> Response:
    return await run_handler(raw_request.app.state.messages.create(body), raw_request)


@router.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=_ANTHROPIC_ERRORS)
async def count_message_tokens(body: CountTokensRequest, raw_request: Request) -> Response:
    return await run_handler(raw_request.app.state.messages.count_tokens(body), raw_request)


def _model_card(request: Request, name: str) -> ModelCard:
    engine = request.app.state.engine
    config = engine.config
    return ModelCard(id=name, root=config.model, max_model_len=config.max_model_len, tasks=served_tasks(engine))


def served_tasks(engine) -> list[str]:
    """The tasks of ``/v1/models``: ``generate`` for a generation engine; a pooling engine's tasks, with
    ``score`` (and so rerank) for an embedder too (cosine of the embeddings)."""
    if getattr(engine, "runner_type", "generate") != "pooling":
        return ["generate"]
    tasks = list(engine.tasks)
    return tasks + ["score"] if "score" not in tasks else tasks


def _adapter_card(request: Request, name: str) -> ModelCard | None:
    """A LoRA adapter's card (its folder as ``root``, the base as ``parent``), or None for another name."""
    chat = request.app.state.chat
    lora = next((r for r in chat.adapters() if r.lora_name == name), None)
    return None if lora is None else ModelCard(id=name, root=lora.lora_path, parent=chat.model_name,
                                                max_model_len=request.app.state.engine.config.max_model_len)


@router.get("/v1/models", response_model=ModelList, responses=errors(401))
async def list_models(raw_request: Request) -> Response:
    chat = raw_request.app.state.chat
    cards = [_model_card(raw_request, name) for name in chat.served_model_names]
    cards += [_adapter_card(raw_request, r.lora_name) for r in chat.adapters()]
    return json_response(ModelList(data=cards))


# OpenAI's "retrieve model" (the SDK's client.models.retrieve); `:path` as served names may hold '/'
@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=errors(401, 404))
async def retrieve_model(model: str, raw_request: Request) -> Response:
    raw_request.app.state.chat.check_model(model)
    return json_response(_adapter_card(raw_request, model) or _model_card(raw_request, model))


@router.get("/health", response_class=Response,
            responses={200: {"description": "Healthy (empty body)", "content": None}, **errors()})
async def health(raw_request: Request) -> Response:
    try:
        await raw_request.app.state.engine.check_health()
    except (EngineDeadError, EngineUnhealthyError) as e:
        return error_response(503, str(e))
    return Response(status_code=200)


@router.get("/version", response_model=VersionResponse, responses=errors())
async def version() -> Response:
    return json_response(VersionResponse(version=pagedllm.__version__))


@router.get("/metrics", response_class=PlainTextResponse, responses={
    200: {"description": "Prometheus text exposition format", "content": {"text/plain": {
        "schema": {"type": "string"}}}}, **errors(404)})
async def metrics(raw_request: Request) -> Response:
    engine_metrics = raw_request.app.state.engine.metrics
    if engine_metrics is None:
        return error_response(404, "metrics are disabled")
    return Response(engine_metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _tokenize(state: Any, body: TokenizeRequest) -> Response:
    state.completions.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", "prompt")
    body.check_template_flags()
    if body.messages is not None:
        ids = await state.chat.render([m.model_dump(exclude_none=True) for m in body.messages],
                                      body.add_generation_prompt, body.continue_final_message,
                                      template_kwargs=state.chat.template_kwargs(body))
    else:
        text, special = body.prompt, body.add_special_tokens
        ids = await state.engine.call_front(lambda f: f.tokenizer.encode(text, add_special_tokens=special))
    return json_response(TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.engine.config.max_model_len))


async def _detokenize(state: Any, body: DetokenizeRequest) -> Response:
    state.completions.check_model(body.model)
    vocab_size = state.engine.vocab_size
    bad = [t for t in body.tokens if t < 0 or t >= vocab_size]
    if bad:
        raise APIError(400, f"tokens contains token id {bad[0]}, outside the vocabulary (size {vocab_size})",
                       "tokens")
    return json_response(DetokenizeResponse(prompt=state.engine.tokenizer.decode(body.tokens,
                                                                                 skip_special_tokens=False)))


@router.post("/tokenize", response_model=TokenizeResponse, responses=errors(*_API_ERRORS))
async def tokenize(body: TokenizeRequest, raw_request: Request) -> Response:
    return await run_handler(_tokenize(raw_request.app.state, body), raw_request)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=errors(*_API_ERRORS))
async def detokenize(body: DetokenizeRequest, raw_request: Request) -> Response:
    return await run_handler(_detokenize(raw_request.app.state, body), raw_request)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    app.state.engine.start()
    yield
    await app.state.engine.shutdown()


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        config, state = app.state.engine.config, app.state
        limits = {"n": state.chat.max_n, "logprobs": config.max_logprobs, "top_logprobs": config.max_logprobs,
                  "prompt_logprobs": config.max_logprobs, "prompt": state.completions.max_prompts,
                  "truncate_prompt_tokens": config.max_model_len}
        app.openapi_schema = finish_document(FastAPI.openapi(app), limits, app.state.engine.vocab_size,
                                             config.max_model_len, has_api_key=state.has_api_key)
    return app.openapi_schema


def build_app(engine: AsyncLLMEngine, served_model_names: list[str] | None = None, *,
              api_key: str | list[str] | None = None, chat_template: str | None = None, max_n: int = 16,
              enable_kv_map: bool = True, max_prompts_per_request: int = DEFAULT_MAX_PROMPTS,
              tool_call_parser: str | None = None, response_store: ResponseStore | None = None,
              kv_cache_isolation: str = "none") -> FastAPI:
    """The FastAPI app serving ``engine`` (started in the app's lifespan, stopped at its end).

    ``served_model_names``: names accepted as ``model`` (default the engine's); ``api_key``: required as
    ``Authorization: Bearer`` or ``x-api-key``; ``chat_template``: overrides the model's; ``max_n``: largest ``n``;
    ``max_prompts_per_request``: most prompts of one completions request; ``tool_call_parser``: for
    ``tool_choice: "auto"`` (default: the one the chat template teaches); ``response_store``: where ``/v1/responses``
    keeps stored responses (default :class:`ResponseStore`'s limits); ``api_key`` may list several keys, and
    ``kv_cache_isolation="api-key"`` gives each its own prefix-cache namespace. Raises ValueError for an unknown
    parser, or for isolation without keys.
    """
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if kv_cache_isolation not in ISOLATION_MODES:
        raise ValueError(f"--kv-cache-isolation must be one of {', '.join(ISOLATION_MODES)}, got {kv_cache_isolation!r}")
    if kv_cache_isolation == "api-key" and not api_keys:
        raise ValueError("--kv-cache-isolation api-key needs API keys (--api-key KEY [KEY ...])")
    names = list(served_model_names or [engine.model_name])
    app = FastAPI(title="pagedllm OpenAI-compatible server", version=pagedllm.__version__, lifespan=_lifespan)
    state = app.state
    state.engine, state.has_api_key, state.in_flight = engine, bool(api_keys), InFlight()
    state.completions = OpenAIServingCompletion(engine, names, max_n=max_n, max_prompts=max_prompts_per_request)
    state.chat = OpenAIServingChat(engine, names, max_n=max_n, chat_template=chat_template,
                                   tool_call_parser=tool_call_parser)
    state.responses = ServingResponses(state.chat, ResponseStore() if response_store is None else response_store)
    state.messages = ServingMessages(state.chat)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys, isolate=kv_cache_isolation == "api-key")
    app.add_middleware(InFlightMiddleware, state=state.in_flight)  # outermost: 503 while draining
    for exc_class, handler in ((APIError, _api_error), (RequestValidationError, _validation_error),
                               (StarletteHTTPException, _http_error), (Exception, _any_error)):
        app.add_exception_handler(exc_class, handler)
    app.include_router(router)
    if engine.config.enable_lora and engine.config.allow_runtime_lora_updating:
        app.include_router(lora_admin_router())
    app.openapi = lambda: _openapi(app)
    if enable_kv_map:
        add_kv_map_routes(app, engine, names[0], requires_api_key=bool(api_keys))
    app.include_router(pooling_router(engine, names, errors(*_API_ERRORS, 500)))  # embeddings, rerank, score
    return app


# ---------------------------------------------------------------------------- command line
def add_server_args(parser: argparse.ArgumentParser, include_engine_args: bool = True) -> argparse.ArgumentParser:
    """Add the ``serve`` flags to ``parser`` (MODEL unless it has a ``model`` destination; with
    ``include_engine_args`` one flag per EngineConfig field unless present) and return it. ``--log-level`` is the
    caller's."""
    from pagedllm.entrypoints.args import add_engine_args

    if not any(a.dest == "model" for a in parser._actions):
        parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                            help=f"model alias, .gguf file or Hugging Face folder (default: {DEFAULT_MODEL})")
        # `--model` as `generate` and `chat` take it (vLLM's serve accepts both spellings too)
        parser.add_argument("-m", "--model", dest="model_flag", default=None, metavar="MODEL",
                            help="the same as the MODEL argument (give one or the other)")
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000)")
    group.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                       help="require one of the KEYs as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                            "(default: $PAGEDLLM_API_KEY, else none)")
    group.add_argument("--kv-cache-isolation", default="none", choices=ISOLATION_MODES,
                       help="api-key: each API key its own prefix-cache namespace (no cached block, count or "
                            "timing shared across keys; docs/robustness.md)")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients use in 'model' (default: the model argument)")
    group.add_argument("--chat-template", default=None, help="file with a Jinja chat template overriding the model's")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how tool calls appear in the model's text, for tool_choice 'auto' "
                            "(default: detected from the chat template)")
    group.add_argument("--max-n", type=int, default=16, help="largest n (samples per request) accepted (default: 16)")
    group.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS,
                       help=f"most prompts in one completions request (default: {DEFAULT_MAX_PROMPTS})")
    group.add_argument("--switch-interval-ms", type=float, default=DEFAULT_SWITCH_INTERVAL_MS,
                       help="most milliseconds the engine thread keeps the GIL while the HTTP loop waits for it "
                            f"(sys.setswitchinterval; Python's default is 5) (default: {DEFAULT_SWITCH_INTERVAL_MS:g})")
    group.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds requests in flight may take to finish after SIGINT/SIGTERM (default: 30)")
    group.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    group.add_argument("--stats-log-interval", type=float, default=10.0,
                       help="seconds between engine status log lines, 0 = off (default: 10)")
    group.add_argument("--disable-kv-map", action="store_true",
                       help="do not serve the live KV-cache map (GET /kv, GET /kv/state)")
    group.add_argument("--response-store-max-count", type=int, default=DEFAULT_MAX_COUNT,
                       help=f"most /v1/responses kept for previous_response_id and GET (default: {DEFAULT_MAX_COUNT})")
    group.add_argument("--response-store-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                       help=f"most bytes of JSON the response store keeps (default: {DEFAULT_MAX_BYTES})")
    group.add_argument("--disable-response-store", action="store_true",
                       help="keep no /v1/responses (store: true is then a no-op and previous_response_id a 400)")
    if include_engine_args and not any(a.dest == "block_size" for a in parser._actions):
        add_engine_args(parser)
    return parser


def _port(text: str) -> int:
    """argparse type of ``--port``: a TCP port, 0..65535 (0 = any free port)."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port from 0 to 65535, got {port}")
    return port


def build_app_from_args(args: argparse.Namespace) -> FastAPI:
    """Load the engine named by ``args`` (blocking) and build the app."""
    from pagedllm.engine.async_pooling_engine import make_async_engine
    from pagedllm.engine.pooling_engine import make_engine
    from pagedllm.entrypoints.args import engine_config_from_args
    from pagedllm.metrics import EngineMetrics

    from pagedllm.utils import resolve_device

    store = response_store_from_args(args)  # bad flags fail before the model loads
    config = engine_config_from_args(args, model=resolve_model_arg(args))
    config = config.with_serving_defaults(resolve_device(config.device).type)
    chat_template = None  # read before the model loads: a wrong path fails at once, by name
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {args.chat_template!r}: {getattr(e, 'strerror', None) or e}") from e
    names = args.served_model_name or [args.model]
    options = dict(metrics=EngineMetrics(names[0]), log_requests=not args.disable_log_requests,
                   stats_log_interval_s=args.stats_log_interval)
    if config.data_parallel_size > 1:
        from pagedllm.engine.data_parallel import DataParallelAsyncEngine

        async_engine = DataParallelAsyncEngine.from_config(config, **options)
    else:
        async_engine = make_async_engine(make_engine(config), **options)
    return build_app(async_engine, names, api_key=resolve_api_key(args), chat_template=chat_template,
                     max_n=args.max_n, enable_kv_map=not args.disable_kv_map,
                     max_prompts_per_request=args.max_prompts_per_request,
                     tool_call_parser=getattr(args, "tool_call_parser", None), response_store=store,
                     kv_cache_isolation=args.kv_cache_isolation)


def response_store_from_args(args: argparse.Namespace) -> ResponseStore:
    """The ``/v1/responses`` store the ``--response-store-*`` flags ask for (raises ValueError naming one)."""
    if getattr(args, "disable_response_store", False):
        return ResponseStore(0, 0)
    count = getattr(args, "response_store_max_count", DEFAULT_MAX_COUNT)
    num_bytes = getattr(args, "response_store_max_bytes", DEFAULT_MAX_BYTES)
    if count < 1 or num_bytes < 1:
        raise ValueError(f"--response-store-max-count and --response-store-max-bytes must be >= 1 "
                         f"(--disable-response-store turns the store off), got {count} and {num_bytes}")
    return ResponseStore(count, num_bytes)


def set_switch_interval(interval_ms: float) -> None:
    """``sys.setswitchinterval`` in ms: how long the engine thread keeps the GIL when the event loop asks (shorter:
    ``/health`` and stream chunks sooner, more switches). Raises ValueError naming ``--switch-interval-ms`` unless
    0 < interval_ms <= 1000."""
    if not 0 < interval_ms <= 1000:
        raise ValueError(f"--switch-interval-ms must be in (0, 1000], got {interval_ms!r}")
    sys.setswitchinterval(interval_ms / 1000.0)


def resolve_api_key(args: argparse.Namespace) -> list[str] | None:
    """``--api-key`` (one or more), else ``$PAGEDLLM_API_KEY``, else None (no authentication)."""
    keys = getattr(args, "api_key", None)
    if isinstance(keys, str):
        keys = [keys]
    if keys:
        return list(keys)
    return [envs.api_key()] if envs.api_key() else None


def resolve_model_arg(args: argparse.Namespace) -> str:
    """The model to serve: ``--model`` when given, else the MODEL argument (its default included);
    stored back in ``args.model``. Raises ValueError when both name different models."""
    flag = getattr(args, "model_flag", None)
    if flag is not None:
        if args.model not in (DEFAULT_MODEL, flag):
            raise ValueError(f"two models given: MODEL {args.model!r} and --model {flag!r}; give one")
        args.model = flag
    return args.model


def run_server(args: argparse.Namespace) -> None:
    """Bind the port, load the model and serve until interrupted (blocking). Raises ValueError on
    bad options, a port that cannot be bound included (before the model loads)."""
    resolve_model_arg(args)  # before the port is bound: two models is a usage error
    set_switch_interval(getattr(args, "switch_interval_ms", DEFAULT_SWITCH_INTERVAL_MS))
    level = str(getattr(args, "log_level", "info")).lower()
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllm").setLevel(level.upper())
    with bind_socket(args.host, args.port) as sock:
        app = build_app_from_args(args)
        port = sock.getsockname()[1]
        logger.info("serving %s on http://%s:%d", args.served_model_name or args.model, args.host, port)
        serve_app(app, args.host, port, level, args.drain_timeout, sock=sock)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free one) before the model loads, so a port in use fails at once,
    and held (not listening: clients are refused during the load) until the server listens on it. SO_REUSEADDR as
    uvicorn. Raises ValueError naming ``--host`` (unknown address) or ``--port`` (in use, no permission)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = "already in use (another server listens there; pick another --port)" \
            if e.errno == errno.EADDRINUSE else e.strerror
        raise ValueError(f"--port {port}: cannot listen on {host}:{port}: {why}") from None
    return sock


def serve_app(app: FastAPI, host: str, port: int, log_level: str = "info", drain_timeout_s: float = 30.0,
              sock: socket.socket | None = None) -> None:
    """Serve an app from :func:`build_app` until SIGINT/SIGTERM, then drain (blocking); on ``sock``
    (from :func:`bind_socket`) when given, else uvicorn binds ``host:port``."""
    import uvicorn

    from pagedllm.entrypoints.openai.connection_limits import RequestHeadLimit, raise_fd_limit, uvicorn_limits

    raise_fd_limit()
    limits = app.state.engine.config
    config = uvicorn.Config(RequestHeadLimit(app, limits.max_header_bytes), host=host, port=port,
                            log_level=log_level, timeout_graceful_shutdown=5, **uvicorn_limits(limits))
    DrainingServer(config, app.state.engine, app.state.in_flight, drain_timeout_s).run(
        sockets=None if sock is None else [sock])


def main(argv: list[str] | None = None) -> None:
    """``python -m pagedllm.entrypoints.openai.api_server [MODEL] [flags]`` (same flags as ``pagedllm serve``)."""
    parser = argparse.ArgumentParser(prog="pagedllm serve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_server_args(parser)
    try:
        run_server(parser.parse_args(argv))
    except ValueError as e:  # bad options: a message, not a traceback (as `pagedllm serve`)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
