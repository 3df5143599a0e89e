import pytest
import torch

import w8a8_cpu

INFO = w8a8_cpu.info()
COMPILED = INFO["compiled_variants"]
RUNNABLE = set(INFO["runnable_variants"])


def _variant_param(name):
    marks = [] if name in RUNNABLE else [pytest.mark.skip(reason=f"this CPU lacks the features of '{name}'")]
    return pytest.param(name, marks=marks, id=name)


@pytest.fixture(params=[_variant_param(v) for v in COMPILED])
def variant(request):
    """Each compiled variant in turn, active for the duration of the test (skipped when the CPU lacks it)."""
    with w8a8_cpu.use_variant(request.param):
        yield request.param


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
