"""cache_salt namespaces the prefix cache: it enters the first block's hash, so requests with
different salts (or one salted, one not) never share a block; the same salt shares as usual."""

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.sampling_params import SamplingParams

from core_helpers import make_request

PROMPT = list(range(10, 27))  # 4 full blocks of 4 and one token


def _admit(kv, req):
    ids, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n, ids, n) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return n


@pytest.mark.parametrize("first, second, num_shared", [
    (None, None, 16), ("tenant-a", "tenant-a", 16), ("tenant-a", "tenant-b", 0), (None, "tenant-b", 0),
    ("tenant-a", None, 0)])
def test_salts_isolate_blocks_and_the_same_salt_shares(first, second, num_shared):
    kv = KVCacheManager(16, 4, True, 64)
    a, b = make_request("a", PROMPT, cache_salt=first), make_request("b", PROMPT, cache_salt=second)
    assert _admit(kv, a) == 0
    hits_before = kv.prefix_cache_hits
    assert _admit(kv, b) == num_shared
    assert kv.prefix_cache_hits - hits_before == num_shared
    same = first == second
    assert (a.block_hashes[0] == b.block_hashes[0]) is same
    assert all((x == y) is same for x, y in zip(a.block_hashes, b.block_hashes))  # chained: every block differs
    shared = set(kv.get_block_ids(a)) & set(kv.get_block_ids(b))
    assert len(shared) == num_shared // 4
    kv.free(a)
    kv.free(b)
    kv.check_integrity()


@pytest.mark.parametrize("salt", ["", 5])
def test_a_bad_salt_is_a_clear_error(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt=salt)
