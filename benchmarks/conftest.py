"""pytest set-up for the benchmark suite (`pytest benchmarks/ --benchmark-only`).

The default `python -m pytest` only collects tests/ (pyproject: testpaths), so this file is loaded
only when benchmarks/ is named. It takes tests/conftest.py's set-up as is: without a CUDA device
the Triton kernels run through Triton's interpreter (switched on when that module is imported,
before triton is), and tests marked gpu are skipped. The repository root is on sys.path here
(benchmarks/ is a package, so pytest inserts its parent).
"""

from tests.conftest import HAS_CUDA, device, pytest_collection_modifyitems  # noqa: F401
