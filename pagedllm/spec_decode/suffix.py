"""Suffix proposer (suffix decoding, as Arctic Inference's): suffix trees (tries of every
substring up to ``max_depth`` tokens, with occurrence counts) over this request's prompt and
output and over recent requests' outputs. The longest suffix of the context found in a tree is
continued by its most frequent children while their estimated probability stays high.

Each tree is updated in O(depth) per appended token: the nodes of the suffixes ending at the
last token are kept, and each takes the new token as a child. A request's own tree is dropped
when it ends; its output joins the shared tree, which keeps the last ``max_cached_requests``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from pagedllm.core.request import Request
from pagedllm.spec_decode.proposer import Proposer


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Substrings (at most ``max_depth`` tokens) of the sequences added, with counts."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Count (``sign`` 1) or uncount (-1) every substring of ``tokens`` up to ``max_depth``."""
        for start in range(len(tokens)):
            node = self.root
            for tok in tokens[start:start + self.max_depth]:
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = _Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[tok]
                    break
                node = child

    def extend(self, active: list[_Node], token: int) -> list[_Node]:
        """Append ``token`` after the suffixes whose end nodes are ``active`` (deepest first);
        returns the new end nodes (an incremental :meth:`add`)."""
        new_active = []
        for node in active[-(self.max_depth - 1):] if self.max_depth > 1 else []:
            new_active.append(self._child(node, token))
        new_active.append(self._child(self.root, token))
        return new_active

    @staticmethod
    def _child(node: _Node, token: int) -> _Node:
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node()
        child.count += 1
        return child

    def match(self, context: Sequence[int], max_len: int) -> tuple[_Node | None, int]:
        """(the node of the longest suffix of ``context``, at most ``max_len`` tokens, that has a
        continuation in the tree, its length); ``(None, 0)`` when none."""
        for length in range(min(max_len, len(context)), 0, -1):
            node = self.root
            for tok in context[len(context) - length:]:
                node = node.children.get(tok)
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0


def grow_draft(node: _Node, num_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
    """(the most frequent path below ``node``, at most ``num_tokens`` long, cut where its
    cumulative probability falls below ``min_token_prob``; the sum of those probabilities,
    the expected number of accepted tokens)."""
    draft, prob, score = [], 1.0, 0.0
    while len(draft) < num_tokens and node.children:
        total = sum(c.count for c in node.children.values())
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        prob *= child.count / total
        if prob < min_token_prob:
            break
        draft.append(token)
        score += prob
        node = child
    return draft, score


class _RequestTree:
    __slots__ = ("tree", "active", "num_indexed")

    def __init__(self, max_depth: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.active: list[_Node] = []
        self.num_indexed = 0


class SuffixProposer(Proposer):
    """``max_depth``: longest substring indexed; ``max_cached_requests``: finished outputs kept in
    the shared tree (0: none); a draft is at most ``max_spec_factor`` x the matched length and
    stops below ``min_token_prob``."""

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.shared = SuffixTree(max_depth)
        self._cached: OrderedDict[str, list[int]] = OrderedDict()  # request id -> output in the shared tree
        self._trees: dict[str, _RequestTree] = {}

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        tokens = request.all_token_ids
        local = self._index(request)
        max_len = max(1, self.max_depth - num_tokens)
        best, best_score = [], 0.0
        for tree in (local.tree, self.shared):
            node, length = tree.match(tokens, max_len)
            if node is None:
                continue
            limit = min(num_tokens, int(self.max_spec_factor * length))
            draft, score = grow_draft(node, limit, self.min_token_prob)
            if score > best_score:
                best, best_score = draft, score
        return best

    def _index(self, request: Request) -> _RequestTree:
        state = self._trees.get(request.request_id)
        if state is None:
            state = self._trees[request.request_id] = _RequestTree(self.max_depth)
        for tok in request.all_token_ids[state.num_indexed:]:
            state.active = state.tree.extend(state.active, tok)
        state.num_indexed = request.num_tokens
        return state

    def on_request_finished(self, request: Request) -> None:
        self.forget(request.request_id)
        if self.max_cached_requests == 0 or not request.output_token_ids:
            return
        output = list(request.output_token_ids)
        self.shared.add(output)
        self._cached[request.request_id] = output
        while len(self._cached) > self.max_cached_requests:
            _, old = self._cached.popitem(last=False)
            self.shared.add(old, sign=-1)

    def forget(self, request_id: str) -> None:
        self._trees.pop(request_id, None)
