"""pagedllm.core must import without torch (its tests run in milliseconds, no model)."""

import subprocess
import sys


def test_core_imports_without_torch():
    code = ("import sys; import pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, "
            "pagedllm.core.block_pool, pagedllm.core.stats, pagedllm.core.request, pagedllm.core.outputs; "
            "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
            "print(','.join(bad)); sys.exit(1 if 'torch' in bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"torch imported by pagedllm.core: {res.stdout} {res.stderr}"
