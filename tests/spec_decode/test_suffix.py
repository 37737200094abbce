"""The suffix proposer: trees against counts by hand, incremental indexing equal to a rebuild,
drafts from this request and from finished requests' outputs."""

from __future__ import annotations

from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.suffix import SuffixProposer, SuffixTree, grow_draft


def _counts(node, prefix=()):
    out = {}
    for tok, child in node.children.items():
        out[prefix + (tok,)] = child.count
        out.update(_counts(child, prefix + (tok,)))
    return out


def test_the_tree_counts_every_substring_up_to_its_depth():
    tree = SuffixTree(2)
    tree.add([1, 2, 1, 2])
    assert _counts(tree.root) == {(1,): 2, (1, 2): 2, (2,): 2, (2, 1): 1}
    tree.add([1, 2, 1, 2], sign=-1)
    assert _counts(tree.root) == {}


def test_incremental_indexing_equals_a_rebuild():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1, 4, 1]
    inc, ref = SuffixTree(4), SuffixTree(4)
    active = []
    for t in tokens:
        active = inc.extend(active, t)
    ref.add(tokens)
    assert _counts(inc.root) == _counts(ref.root)


def test_the_longest_match_is_continued_by_the_most_frequent_child():
    tree = SuffixTree(8)
    tree.add([7, 1, 2, 3, 4, 0, 1, 2, 3, 4, 9, 5, 2, 3, 8])
    node, length = tree.match([6, 1, 2, 3], max_len=6)
    assert length == 3  # [1, 2, 3], seen twice, both times followed by 4
    draft, score = grow_draft(node, 4, 0.1)
    assert (draft, score) == ([4, 0, 1, 2], 2.5)  # 4 always, then one of two continuations: 1/2
    assert grow_draft(node, 1, 0.1) == ([4], 1.0)


def _request(rid, prompt, output=()):
    req = Request(rid, prompt, SamplingParams(max_tokens=32), max_tokens=32)
    req.append_output_token_ids(list(output))
    return req


def test_drafts_come_from_the_request_and_from_finished_outputs():
    proposer = SuffixProposer(max_depth=16, max_cached_requests=2, max_spec_factor=2.0, min_token_prob=0.1)
    req = _request("a", [5, 6, 7, 8, 9, 5, 6])
    assert proposer.propose(req, 3) == [7, 8, 9]
    done = _request("b", [1], [20, 21, 22, 23, 24])
    proposer.on_request_finished(done)
    other = _request("c", [40, 20, 21])
    assert proposer.propose(other, 3) == [22, 23, 24]
    for i in range(3):  # the shared tree keeps the last two outputs only
        proposer.on_request_finished(_request(f"x{i}", [1], [60 + i, 61]))
    assert proposer.propose(_request("d", [40, 20, 21]), 3) == []
