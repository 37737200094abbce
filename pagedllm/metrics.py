"""Prometheus metrics named as vLLM names them (``vllm:`` → ``pagedllm:``), labelled ``model_name`` and ``engine``.

Counters are scraped with ``_total`` appended, as in vLLM. Thread-safe: the engine thread records
while the HTTP thread scrapes. Each registry is its own, so several servers can live in one process.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["EngineMetrics", "CONTENT_TYPE_LATEST"]

# Buckets as in vLLM's v1 loggers (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

FINISH_REASONS = ("stop", "length", "abort", "error")


class _Families:

    def __init__(self, registry: CollectorRegistry) -> None:
        r, lbl = registry, ["model_name", "engine"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedllm:{name}", doc, lbl, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedllm:{name}", doc, lbl, registry=r)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, lbl, buckets=buckets, registry=r)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage: fraction of blocks in use (0..1).")
        self.num_kv_blocks_used = gauge("num_kv_blocks_used", "KV-cache blocks referenced by a request.")
        self.num_kv_blocks_total = gauge("num_kv_blocks_total", "KV-cache blocks in the pool.")
        self.engine_healthy = gauge("engine_healthy", "1 while the engine loop is alive and its last step succeeded.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.kv_offload_io_errors = counter("kv_offload_io_errors", "KV offload tier reads and writes that failed "
                                            "(each a cache miss: the block is recomputed or not stored).")
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Speculative drafts verified.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "pagedllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.",
            [*lbl, "position"], registry=r)
        self.request_success = Counter("pagedllm:request_success", "Finished requests by finish reason.",
                                       [*lbl, "finished_reason"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (s).", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens (s).",
                             _ITL_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per request (s).", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish (s).", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled (s).",
                                    _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length per request (tokens).",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per request (all n sequences).",
                                                   _TOKEN_BUCKETS)


_PER_ENGINE = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_kv_blocks_used",
               "num_kv_blocks_total", "engine_healthy", "prefix_cache_queries", "prefix_cache_hits",
               "num_preemptions", "prompt_tokens", "generation_tokens", "ttft", "itl", "tpot", "e2e", "queue_time",
               "request_prompt_tokens", "request_generation_tokens", "kv_offload_io_errors", "spec_decode_num_drafts",
               "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class EngineMetrics:
    """The metrics of one data-parallel replica (label ``engine``); :meth:`render` exposes every replica's."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, engine_index: int = 0,
                 *, _families: _Families | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.engine_index = engine_index
        self._families = _families if _families is not None else _Families(self.registry)
        labels = (model_name, str(engine_index))
        for name in _PER_ENGINE:
            setattr(self, name, getattr(self._families, name).labels(*labels))
        self._success = self._families.request_success
        for reason in FINISH_REASONS:  # expose zeros from the start, as vLLM does
            self._success.labels(*labels, reason)
        self._lock = threading.Lock()
        self._last_totals: dict[str, int] = {}
        self._labels = labels
        self._last_per_pos: tuple[int, ...] = ()

    def for_engine(self, engine_index: int) -> "EngineMetrics":
        return EngineMetrics(self.model_name, self.registry, engine_index, _families=self._families)

    def record_stats(self, stats: Any) -> None:
        """Set gauges from an EngineStats snapshot; counters grow by the increase since the last one."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(float(stats.kv_cache_usage))
        self.num_kv_blocks_used.set(stats.num_used_blocks)
        self.num_kv_blocks_total.set(stats.num_total_blocks)
        with self._lock:
            for name, metric in (("prefix_cache_queries", self.prefix_cache_queries),
                                 ("prefix_cache_hits", self.prefix_cache_hits),
                                 ("num_preemptions_total", self.num_preemptions),
                                 ("prompt_tokens_total", self.prompt_tokens),
                                 ("generation_tokens_total", self.generation_tokens),
                                 ("kv_offload_io_errors_total", self.kv_offload_io_errors),
                                 ("spec_decode_num_drafts", self.spec_decode_num_drafts),
                                 ("spec_decode_num_draft_tokens", self.spec_decode_num_draft_tokens),
                                 ("spec_decode_num_accepted_tokens", self.spec_decode_num_accepted_tokens)):
                total = int(getattr(stats, name, 0))
                increase = total - self._last_totals.get(name, 0)
                if increase > 0:
                    metric.inc(increase)
                self._last_totals[name] = total
            self._record_per_position(tuple(getattr(stats, "spec_decode_num_accepted_tokens_per_pos", ())))

    def _record_per_position(self, per_pos: tuple[int, ...]) -> None:
        family = self._families.spec_decode_num_accepted_tokens_per_pos
        for pos, total in enumerate(per_pos):
            increase = total - (self._last_per_pos[pos] if pos < len(self._last_per_pos) else 0)
            if increase > 0:
                family.labels(*self._labels, str(pos)).inc(increase)
        self._last_per_pos = per_pos

    def set_healthy(self, is_healthy: bool) -> None:
        self.engine_healthy.set(1 if is_healthy else 0)

    def record_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(max(ttft_s, 0.0))

    def record_inter_token(self, itl_s: float) -> None:
        self.itl.observe(max(itl_s, 0.0))

    def record_finished(self, finish_reason: str, e2e_s: float, queue_s: float | None,
                        num_prompt_tokens: int, num_generation_tokens: int, tpot_s: float | None) -> None:
        self._success.labels(self.model_name, str(self.engine_index), finish_reason or "abort").inc()
        self.e2e.observe(max(e2e_s, 0.0))
        if queue_s is not None:
            self.queue_time.observe(max(queue_s, 0.0))
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        if tpot_s is not None:
            self.tpot.observe(max(tpot_s, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
