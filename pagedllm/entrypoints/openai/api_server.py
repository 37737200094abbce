"""The OpenAI-compatible HTTP server: ``pagedllm serve [MODEL] --host --port --api-key ...``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{model}``,
``GET /health``, ``GET /version``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``
(Prometheus), ``GET /kv`` and ``GET /kv/state`` (the live KV-cache map; off with
``--disable-kv-map``), ``GET /openapi.json``. Without a key stay open: probes, scrapers,
the document and the ``/kv`` page (no data). The error contract, limits and shutdown are
in ``docs/architecture.md`` ("The HTTP server"). Run it with :func:`run_server` or
``python -m pagedllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hmac
import logging
import os
import re
import socket
import sys
from typing import Any, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.config import DEFAULT_MODEL
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineUnhealthyError
from pagedllm.entrypoints.openai.errors import APIError, error_response, to_api_error
from pagedllm.entrypoints.openai.kv_map import KV_PAGE_PATH, add_kv_map_routes
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, DetokenizeRequest,
    DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse, VersionResponse)
from pagedllm.entrypoints.openai.openapi import errors, finish_document, json_or_sse
from pagedllm.entrypoints.openai.lifecycle import DrainingServer, InFlight, InFlightMiddleware
from pagedllm.entrypoints.openai.serving_base import ClientDisconnected, json_response, until_disconnected
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
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


class APIKeyMiddleware:
    """Pure-ASGI check of ``Authorization: Bearer <key>`` (streaming-safe, unlike BaseHTTPMiddleware).

    Runs before the body is read, so a wrong key gets 401 whatever the body holds. The
    scheme name is case-insensitive (RFC 9110 section 11.1); the key is compared in
    constant time.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    def _is_authorized(self, scope: dict) -> bool:
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS" and not scope["path"].startswith(_OPEN_PATHS)
                and scope["path"] not in _OPEN_PAGES and not self._is_authorized(scope)):
            response = error_response(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


# Segments pydantic adds to an error's location for the member of a union or the validator that
# failed ("constrained-str", "list[TextPart]", "function-after[...]", "str", "[key]"): not part
# of the request's path, so a client never sees them.
_UNION_TAG = re.compile(r"^(?:(?:constrained|function|lax|json|tagged|chain|nullable|default)-[\w-]+(?:\[.*\])?"
                        r"|\w+\[.*\]|str|int|float|bool|\[key\])$")


def _request_path(error: dict) -> list[str]:
    """The error's location in the request body: field names, list indices and dict keys."""
    loc = [str(p) for p in error.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "header"):  # where it came from, not the field
        loc = loc[1:]
    return [p for p in loc if not _UNION_TAG.match(p)]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message (and the offending field) from pydantic's error list: the error
    deepest in the body, the most specific one (a value that fits no member of a union fails
    each member; the member that got furthest names what is wrong, and among equals one whose
    type matched the value: ``[]`` for a string-or-list field is a list too short, not a
    wrong type)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = max(errors, key=lambda e: (len(_request_path(e)), not str(e.get("type", "")).endswith("_type")))
    if first.get("type") == "json_invalid":
        return "Malformed JSON in the request body: " + str(first.get("ctx", {}).get("error", first.get("msg"))), None
    loc = _request_path(first)
    field = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    if first.get("type") == "missing":
        return f"{where}: field required", field
    value = first.get("input")
    shown = "" if isinstance(value, (dict, list)) else f", got {value!r}"
    return f"{where}: {first.get('msg', 'invalid value')}{shown}"[:500], field


def build_app(engine: AsyncLLMEngine, served_model_names: list[str] | None = None, *, api_key: str | None = None,
              chat_template: str | None = None, max_n: int = 16, enable_kv_map: bool = True,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS, tool_call_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (started in the app's lifespan, stopped at its end).

    Args:
        engine: the AsyncLLMEngine (its thread starts with the app).
        served_model_names: names accepted as ``model``; default the engine's model name.
        api_key: require ``Authorization: Bearer <api_key>`` on the API routes.
        chat_template: Jinja chat template overriding the model's.
        max_n: largest ``n`` per request.
        enable_kv_map: serve the live KV-cache map at ``/kv`` and ``/kv/state``.
        max_prompts_per_request: most prompts in one completions request (400 beyond).
        tool_call_parser: the tool-call parser for ``tool_choice: "auto"`` (e.g. ``hermes``);
            default: the one the chat template teaches, if any.

    ``app.state.in_flight`` counts requests in flight; :class:`DrainingServer` drains with it.
    Raises ValueError for an unknown ``tool_call_parser``.
    """
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)
    names = list(served_model_names or [engine.model_name])
    completions = OpenAIServingCompletion(engine, names, max_n=max_n, max_prompts=max_prompts_per_request)
    chat = OpenAIServingChat(engine, names, max_n=max_n, chat_template=chat_template,
                             tool_call_parser=tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=pagedllm.__version__, lifespan=lifespan)
    app.state.engine = engine
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.state.in_flight = InFlight()
    app.add_middleware(InFlightMiddleware, state=app.state.in_flight)  # outermost: 503 while draining

    # ------------------------------------------------------------------ error handlers
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(exc)
        return error_response(400, message, field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)  # 405 keeps its Allow

    @app.exception_handler(Exception)
    async def _any_error(_: Request, exc: Exception) -> JSONResponse:
        err = to_api_error(exc, _REQUEST_FIELDS)
        if err.status == 500:
            logger.exception("unhandled error", exc_info=exc)
        return error_response(err.status, err.message, err.param)

    async def handle(coro: Awaitable[Response], raw_request: Request | None = None) -> Response:
        """Run a handler until done or the client leaves; map its exceptions to OpenAI error
        responses (never a traceback)."""
        try:
            return await until_disconnected(coro, raw_request)
        except ClientDisconnected:
            logger.info("client disconnected; its request was aborted")
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
        except Exception as e:  # noqa: BLE001
            err = to_api_error(e, _REQUEST_FIELDS)
            if err.status == 500 and not isinstance(e, APIError):
                logger.exception("request failed", exc_info=e)
            return error_response(err.status, err.message, err.param)

    # ------------------------------------------------------------------ routes
    auth_errors = (401,) if api_key else ()
    api_errors = (400, *auth_errors, 404)
    limits = {"n": max_n, "logprobs": engine.config.max_logprobs, "top_logprobs": engine.config.max_logprobs,
              "prompt_logprobs": engine.config.max_logprobs, "prompt": max_prompts_per_request,
              "truncate_prompt_tokens": engine.config.max_model_len}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = finish_document(FastAPI.openapi(app), limits, engine.vocab_size,
                                                 engine.config.max_model_len)
        return app.openapi_schema

    app.openapi = openapi
    @app.post("/v1/completions", responses={**json_or_sse(CompletionResponse), **errors(*api_errors, 500)})
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await handle(completions.create_completion(body), raw_request)

    @app.post("/v1/chat/completions", responses={**json_or_sse(ChatCompletionResponse),
                                                  **errors(*api_errors, 500)})
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await handle(chat.create_chat_completion(body), raw_request)

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, root=engine.config.model, max_model_len=engine.config.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=errors(*auth_errors))
    async def list_models() -> Response:
        return json_response(ModelList(data=[model_card(name) for name in names]))

    # OpenAI's "retrieve model" (the SDK's client.models.retrieve); `:path` as served names may hold '/'
    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=errors(*auth_errors, 404))
    async def retrieve_model(model: str) -> Response:
        chat.check_model(model)
        return json_response(model_card(model))

    @app.get("/health", response_class=Response,
             responses={200: {"description": "Healthy (empty body)", "content": None}, **errors()})
    async def health() -> Response:
        try:
            await engine.check_health()
        except (EngineDeadError, EngineUnhealthyError) as e:
            return error_response(503, str(e))
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse, responses=errors())
    async def version() -> Response:
        return json_response(VersionResponse(version=pagedllm.__version__))

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text exposition format", "content": {"text/plain": {
            "schema": {"type": "string"}}}}, **errors(404)})
    async def metrics() -> Response:
        if engine.metrics is None:
            return error_response(404, "metrics are disabled")
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors(*api_errors))
    async def tokenize(body: TokenizeRequest) -> Response:
        async def run() -> Response:
            completions.check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise APIError(400, "give exactly one of prompt or messages", "prompt")
            body.check_template_flags()
            if body.messages is not None:
                ids = await chat.render([m.model_dump(exclude_none=True) for m in body.messages],
                                        body.add_generation_prompt, body.continue_final_message)
            else:
                text, special = body.prompt, body.add_special_tokens
                ids = await engine.call_front(lambda f: f.tokenizer.encode(text, add_special_tokens=special))
            return json_response(TokenizeResponse(tokens=ids, count=len(ids),
                                                  max_model_len=engine.config.max_model_len))
        return await handle(run())

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors(*api_errors))
    async def detokenize(body: DetokenizeRequest) -> Response:
        async def run() -> Response:
            completions.check_model(body.model)
            bad = [t for t in body.tokens if t < 0 or t >= engine.vocab_size]
            if bad:
                raise APIError(400, f"tokens contains token id {bad[0]}, outside the vocabulary "
                                    f"(size {engine.vocab_size})", "tokens")
            text = engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
            return json_response(DetokenizeResponse(prompt=text))
        return await handle(run())

    if enable_kv_map:
        add_kv_map_routes(app, engine, names[0], requires_api_key=bool(api_key))
    return app


# ---------------------------------------------------------------------------- command line
def add_server_args(parser: argparse.ArgumentParser, include_engine_args: bool = True) -> argparse.ArgumentParser:
    """Add the ``serve`` flags to ``parser`` and return it.

    Adds MODEL (positional, optional; skipped when the parser already has a ``model``
    destination), --host, --port, --api-key, --served-model-name, --chat-template, --tool-call-parser,
    --max-n, --disable-log-requests, --stats-log-interval; with ``include_engine_args``
    also one flag per EngineConfig field (``pagedllm.entrypoints.args.add_engine_args``,
    skipped when the parser already has them). ``--log-level`` is left to the caller
    (``pagedllm --log-level``); :func:`run_server` reads ``args.log_level`` if present.
    """
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
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (default: $PAGEDLLM_API_KEY, else none)")
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
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.args import engine_config_from_args
    from pagedllm.metrics import EngineMetrics

    from pagedllm.worker.model_runner import resolve_device

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
        async_engine = AsyncLLMEngine(LLMEngine(config), **options)
    return build_app(async_engine, names, api_key=resolve_api_key(args), chat_template=chat_template,
                     max_n=args.max_n, enable_kv_map=not args.disable_kv_map,
                     max_prompts_per_request=args.max_prompts_per_request,
                     tool_call_parser=getattr(args, "tool_call_parser", None))


def set_switch_interval(interval_ms: float) -> None:
    """Set the interpreter's thread switch interval (``sys.setswitchinterval``, in ms here).

    The engine thread's Python work (scheduling, input preparation, detokenization) keeps
    the GIL up to this long each time the event loop asks for it; a shorter interval lets
    the loop answer ``/health`` and write stream chunks sooner, at the price of more
    switches. Raises ValueError naming ``--switch-interval-ms`` unless 0 < interval_ms <= 1000.
    """
    if not 0 < interval_ms <= 1000:
        raise ValueError(f"--switch-interval-ms must be in (0, 1000], got {interval_ms!r}")
    sys.setswitchinterval(interval_ms / 1000.0)


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$PAGEDLLM_API_KEY``, else None (no authentication)."""
    return getattr(args, "api_key", None) or os.environ.get("PAGEDLLM_API_KEY") or None


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
    """A TCP socket bound to ``host:port`` (port 0: a free one), for the server to listen on.

    Bound before the model loads, so a port in use fails in a second rather than after minutes
    of loading, and held until the server listens on this very socket (no other process can
    take the port meanwhile; not listening yet, so clients are refused rather than left
    waiting during the load). SO_REUSEADDR as uvicorn sets it: a port in TIME_WAIT is free.
    Raises ValueError naming ``--host`` (unknown address) or ``--port`` (in use, no permission).
    """
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
