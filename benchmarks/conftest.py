"""pytest set-up for the benchmark suite (`pytest benchmarks/ --benchmark-only`).

The default `python -m pytest` only collects tests/ (pyproject: testpaths), so this file is loaded
only when benchmarks/ is named. As in tests/conftest.py: without a CUDA device the Triton kernels
run through Triton's interpreter, which must be switched on before triton is first imported, and
tests marked gpu are skipped.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")
