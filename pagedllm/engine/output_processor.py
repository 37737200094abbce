"""OutputProcessor: scheduler results → detokenized, user-facing RequestOutputs.

One :class:`RequestState` per user request, one detokenizer per child sequence; a stop-string
match finishes the child, and the engine then tells the scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.core.outputs import ModelRunnerOutput, SampleLogprobs
from pagedllm.core.request import Request, RequestStatus
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SequenceState:
    """One generated sequence (child ``index`` of a user request)."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    num_tokens_seen: int = 0  # output tokens already passed to the detokenizer
    num_tokens_sent: int = 0  # output tokens already in a DELTA output
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    final_sent: bool = False  # the output carrying finish_reason went out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def has_news(self) -> bool:
        """New tokens, or a finish not yet reported (DELTA outputs skip sequences without either)."""
        return self.num_tokens_sent < self.num_tokens_seen or (self.finished and not self.final_sent)


@dataclass
class RequestState:
    """One user request and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)


@dataclass
class ProcessedStep:
    """The outputs of one step, and the children a stop string finished."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stop_string_finished: list[str] = field(default_factory=list)


class OutputProcessor:
    """Builds RequestOutputs; engine thread only."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, request_id: str, prompt: str | None, children: list[Request],
                    params: SamplingParams, arrival_time: float) -> None:
        seqs = []
        for i, child in enumerate(children):
            detok = IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, child.sampling_params)
            wants_lp = child.sampling_params.logprobs is not None
            seqs.append(SequenceState(child, i, detok, logprobs=[] if wants_lp else None,
                                      cumulative_logprob=0.0 if wants_lp else None))
            self.child_to_parent[child.request_id] = (request_id, i)
        self.requests[request_id] = RequestState(
            request_id, prompt, children[0].prompt_token_ids, params, seqs, RequestMetrics(arrival_time),
            prompt_logprobs=[] if params.prompt_logprobs is not None else None)

    def remove_request(self, request_id: str) -> list[str]:
        """Forget a user request; returns its child ids (for the scheduler to abort)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        ids = [s.request.request_id for s in state.sequences]
        for cid in ids:
            self.child_to_parent.pop(cid, None)
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def process(self, updated: list[Request], runner_output: ModelRunnerOutput) -> ProcessedStep:
        """Detokenize the updated children and build this step's outputs."""
        now = time.time()
        step = ProcessedStep()
        touched: dict[str, RequestState] = {}
        for cid, entries in runner_output.prompt_logprobs.items():
            parent = self.child_to_parent.get(cid)
            if parent is not None and parent[1] == 0:
                st = self.requests[parent[0]]
                if st.prompt_logprobs is not None:
                    st.prompt_logprobs.extend(self._convert_prompt_logprobs(st, entries))
        for req in updated:
            parent = self.child_to_parent.get(req.request_id)
            if parent is None:
                continue
            st = self.requests[parent[0]]
            seq = st.sequences[parent[1]]
            if self._update_sequence(st, seq, runner_output):
                step.stop_string_finished.append(req.request_id)
            if req.request_id in runner_output.failed:
                st.error = runner_output.failed[req.request_id]
            touched[st.request_id] = st
        for st in touched.values():
            out = self._make_output(st, now)
            if out is not None:
                step.outputs.append(out)
            if st.finished:
                self.remove_request(st.request_id)
        return step

    def _update_sequence(self, st: RequestState, seq: SequenceState, ro: ModelRunnerOutput) -> bool:
        """Feed new tokens to the detokenizer; returns True if a stop string finished the sequence."""
        req = seq.request
        new_ids = req.output_token_ids[seq.num_tokens_seen:]
        if st.metrics.first_token_time is None:  # recorded by the scheduler when the token was appended
            st.metrics.first_token_time = req.first_token_time
        if st.metrics.first_scheduled_time is None:
            st.metrics.first_scheduled_time = req.first_scheduled_time
        if req.cached_tokens_by_tier is not None and (st.metrics.cached_tokens_by_tier is None
                                                      or req.num_cached_tokens > st.num_cached_tokens):
            # the child that reused the most tells the story
            st.metrics.cached_tokens_by_tier = dict(req.cached_tokens_by_tier or {})
        st.num_cached_tokens = max(st.num_cached_tokens, req.num_cached_tokens, 0)
        status = req.status
        ended_by_token = (status == RequestStatus.FINISHED_STOPPED and not isinstance(req.stop_reason, str)
                          and not req.sampling_params.include_stop_str_in_output)
        num_ids_before = len(seq.detokenizer.token_ids)
        stop_str = seq.detokenizer.update(new_ids, stop_terminated=ended_by_token) if new_ids else None
        # a stop string inside a verify step's tokens ends the sequence there: later ids are dropped
        num_kept = len(seq.detokenizer.token_ids) - num_ids_before if stop_str is not None else len(new_ids)
        seq.num_tokens_seen += num_kept
        self._add_logprobs(seq, ro.logprobs.get(req.request_id), num_kept)
        # a stop string wins over a length cap hit by the same token (vLLM checks stop strings first)
        if stop_str is not None and (not status.is_finished or status == RequestStatus.FINISHED_LENGTH_CAPPED):
            seq.finish_reason, seq.stop_reason = "stop", stop_str
            return not status.is_finished
        if status.is_finished:
            seq.finish_reason = status.finish_reason
            seq.stop_reason = req.stop_reason
        return False

    def _add_logprobs(self, seq: SequenceState, lp: SampleLogprobs | list[SampleLogprobs] | None,
                      num_kept: int) -> None:
        """The logprobs of this step's first ``num_kept`` tokens (a verify step sends one per token)."""
        if lp is None or seq.logprobs is None:
            return
        for entry in (lp if isinstance(lp, list) else [lp])[:num_kept]:
            seq.logprobs.append(self._convert_logprobs(seq, entry))
            seq.cumulative_logprob += entry.sampled_logprob

    def _convert_logprobs(self, seq: SequenceState, lp: SampleLogprobs) -> PositionLogprobs:
        decode = seq.detokenizer.decode_token
        d: PositionLogprobs = {}
        for rank, (tid, val) in enumerate(zip(lp.token_ids, lp.logprobs), start=1):
            d[tid] = Logprob(val, rank, decode(tid))
        if lp.sampled_token_id not in d:
            d[lp.sampled_token_id] = Logprob(lp.sampled_logprob, lp.sampled_rank, decode(lp.sampled_token_id))
        return d

    def _convert_prompt_logprobs(self, st: RequestState, entries: list[SampleLogprobs | None]
                                 ) -> list[PositionLogprobs | None]:
        seq = st.sequences[0]
        return [None if e is None else self._convert_logprobs(seq, e) for e in entries]

    def _make_output(self, st: RequestState, now: float) -> RequestOutput | None:
        kind = st.params.output_kind
        finished = st.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = []
        for seq in st.sequences:
            if delta and not seq.has_news():
                continue
            completions.append(self._completion(seq, delta))
        if finished:
            st.metrics.finished_time = now
            st.metrics.num_preemptions = sum(s.request.num_preemptions for s in st.sequences)
            st.metrics.preemption_modes = [m for s in st.sequences for m in s.request.preemption_modes]
            st.metrics.num_draft_tokens = sum(s.request.num_draft_tokens for s in st.sequences)
            st.metrics.num_accepted_tokens = sum(s.request.num_accepted_tokens for s in st.sequences)
        if delta and not completions and not finished:
            return None
        return RequestOutput(
            request_id=st.request_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
            outputs=completions, finished=finished,
            prompt_logprobs=st.prompt_logprobs, num_cached_tokens=st.num_cached_tokens,
            metrics=st.metrics, error=st.error)

    def _completion(self, seq: SequenceState, delta: bool) -> CompletionOutput:
        text = seq.detokenizer.get_next_output_text(seq.finished, delta)
        ids = seq.request.output_token_ids
        start = seq.num_tokens_sent if delta else 0
        token_ids = list(ids[start:seq.num_tokens_seen])
        logprobs = None
        if seq.logprobs is not None:
            logprobs = seq.logprobs[start:seq.num_tokens_seen] if delta else list(seq.logprobs)
        seq.num_tokens_sent = seq.num_tokens_seen
        seq.final_sent = seq.finished
        return CompletionOutput(seq.index, text, token_ids, seq.cumulative_logprob, logprobs,
                                seq.finish_reason, seq.stop_reason)
