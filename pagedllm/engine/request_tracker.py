"""Per-request timing for the server (Prometheus histograms, a line per finished request) and
the periodic status line, fed by the engine thread after each step. Time to first token comes
from ``RequestOutput.metrics``; only inter-token gaps are timed here."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import EngineStats
    from pagedllm.metrics import EngineMetrics

logger = logging.getLogger("pagedllm.async_engine")

__all__ = ["RequestTracker", "StatusLogger"]


@dataclass
class _Timing:
    label: str
    arrival_time: float
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)


class RequestTracker:
    """Timing of the requests the engine runs, keyed by internal request id. Engine thread only."""

    def __init__(self, metrics: "EngineMetrics | None", log_requests: bool) -> None:
        self.metrics = metrics
        self.log_requests = log_requests
        self._timings: dict[str, _Timing] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._timings

    def start(self, request_id: str, label: str, arrival_time: float) -> None:
        """Begin timing a request the engine accepted."""
        self._timings[request_id] = _Timing(label, arrival_time)

    def observe(self, outputs: list[RequestOutput], now: float) -> None:
        """Account one step's outputs (``now``: seconds since the epoch, when they came)."""
        for out in outputs:
            t = self._timings.get(out.request_id)
            if t is not None:
                self._observe_one(out, t, now)

    def abort(self, request_ids: list[str], now: float) -> None:
        """Finish the timing of aborted requests (unknown ids are ignored)."""
        for rid in request_ids:
            if rid in self._timings:
                self._finish(rid, "abort", now, None)

    def _observe_one(self, out: RequestOutput, t: _Timing, now: float) -> None:
        t.num_prompt_tokens = len(out.prompt_token_ids)
        t.num_cached_tokens = out.num_cached_tokens
        num_new = sum(len(c.token_ids) for c in out.outputs)
        if num_new:
            if t.first_token_time is None:
                recorded = out.metrics.first_token_time if out.metrics is not None else None
                t.first_token_time = recorded if recorded is not None else now
                if self.metrics is not None:
                    self.metrics.record_first_token(t.first_token_time - t.arrival_time)
            elif self.metrics is not None:
                self.metrics.record_inter_token(now - t.last_token_time)
            t.last_token_time = now
            t.num_output_tokens += num_new
        for c in out.outputs:
            if c.finish_reason is not None:
                t.finish_reasons[c.index] = c.finish_reason
        if out.finished:
            reason = "error" if out.error is not None else t.finish_reasons.get(0, "stop")
            first_scheduled = out.metrics.first_scheduled_time if out.metrics is not None else None
            self._finish(out.request_id, reason, now, first_scheduled)

    def _finish(self, request_id: str, reason: str, now: float, first_scheduled: float | None) -> None:
        t = self._timings.pop(request_id)
        e2e = now - t.arrival_time
        ttft = None if t.first_token_time is None else t.first_token_time - t.arrival_time
        if self.metrics is not None:
            queue_s = None if first_scheduled is None else first_scheduled - t.arrival_time
            tpot = None
            if t.num_output_tokens > 1 and t.first_token_time is not None:
                tpot = (t.last_token_time - t.first_token_time) / (t.num_output_tokens - 1)
            self.metrics.record_finished(reason, e2e, queue_s, t.num_prompt_tokens, t.num_output_tokens, tpot)
        if self.log_requests:
            logger.info("request %s finished: reason=%s prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
                        "ttft=%s total=%.3fs", t.label, reason, t.num_prompt_tokens, t.num_output_tokens,
                        t.num_cached_tokens, "-" if ttft is None else f"{ttft:.3f}s", e2e)


class StatusLogger:
    """One INFO line of engine state and throughput (counter increase over the time since the
    previous line) every ``interval_s`` seconds while busy; 0 disables it."""

    def __init__(self, interval_s: float, stats: "EngineStats", name: str = "engine") -> None:
        self.interval_s = interval_s
        self.name = name  # starts the line: "engine 1" for a data-parallel replica
        self._last_time = time.monotonic()
        self._last_stats = stats

    def maybe_log(self, stats: "EngineStats") -> None:
        if self.interval_s <= 0 or time.monotonic() - self._last_time < self.interval_s:
            return
        now = time.monotonic()
        s, prev = stats, self._last_stats
        dt = max(now - self._last_time, 1e-9)
        self._last_time, self._last_stats = now, s
        if s.num_steps == prev.num_steps and not s.num_running and not s.num_waiting:
            return  # idle: nothing new to say
        queries = s.prefix_cache_queries - prev.prefix_cache_queries
        hits = s.prefix_cache_hits - prev.prefix_cache_hits
        logger.info("%s: running=%d waiting=%d kv_usage=%.1f%% prefix_cache_hit_rate=%.1f%% "
                    "prompt_throughput=%.1f tok/s generation_throughput=%.1f tok/s preemptions=%d",
                    self.name, s.num_running, s.num_waiting, 100.0 * s.kv_cache_usage,
                    100.0 * hits / queries if queries else 0.0,
                    (s.prompt_tokens_total - prev.prompt_tokens_total) / dt,
                    (s.generation_tokens_total - prev.generation_tokens_total) / dt, s.num_preemptions_total)
        self._log_spec_decode(s, prev)

    def _log_spec_decode(self, s: "EngineStats", prev: "EngineStats") -> None:
        """Speculative decoding since the last line: acceptance rate, tokens per verify step, and
        the acceptance rate at each draft position (vLLM's SpecDecoding metrics line)."""
        drafts = getattr(s, "spec_decode_num_drafts", 0) - getattr(prev, "spec_decode_num_drafts", 0)
        if drafts <= 0:
            return
        drafted = s.spec_decode_num_draft_tokens - prev.spec_decode_num_draft_tokens
        accepted = s.spec_decode_num_accepted_tokens - prev.spec_decode_num_accepted_tokens
        before = prev.spec_decode_num_accepted_tokens_per_pos
        per_pos = [(n - (before[i] if i < len(before) else 0)) / drafts
                   for i, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos)]
        logger.info("%s: spec_decode acceptance_rate=%.1f%% mean_acceptance_length=%.2f drafted=%d accepted=%d "
                    "per_position=[%s]", self.name, 100.0 * accepted / drafted if drafted else 0.0,
                    1.0 + accepted / drafts, drafted, accepted, ", ".join(f"{p:.2f}" for p in per_pos))
