"""A request that failed inside the engine because of its own input is a 400; any other failure a 500."""

from types import SimpleNamespace

import pytest

from pagedllm.core.step_failure import InputError
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.serving_base import raise_if_failed


@pytest.mark.parametrize("error, status", [(InputError("structured_outputs.regex admits no output"), 400),
                                           ("RuntimeError: boom", 500)])
def test_status_follows_the_cause(error, status):
    with pytest.raises(APIError) as e:
        raise_if_failed(SimpleNamespace(error=error))
    assert e.value.status == status and str(error) in e.value.message
    raise_if_failed(SimpleNamespace(error=None))
