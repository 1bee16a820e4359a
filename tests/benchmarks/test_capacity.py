"""benchmarks/capacity.py: the search for the longest completion within a memory budget, and one
real probe at the tiny size."""

from types import SimpleNamespace

import pytest

capacity = pytest.importorskip("benchmarks.capacity")


def test_search_doubles_then_bisects_to_the_resolution(monkeypatch):
    seen = []

    def fake_probe(args, provider, length):  # fits up to 3000 tokens
        seen.append(length)
        return dict(length=length, fits=length <= 3000, peak_gib=length / 1000, status="ok")

    monkeypatch.setattr(capacity, "probe", fake_probe)
    args = SimpleNamespace(start=1024, max_length=131072, resolution=0.125)
    length, probes = capacity.search(args, "trl")
    assert seen == [1024, 2048, 4096, 3072, 2560, 2816] and length == 2816
    assert 3072 <= length * (1 + args.resolution) and all(n % 64 == 0 for n in seen)
    assert [p["length"] for p in probes] == seen
    # everything fits up to --max_length
    args.max_length = 2048
    assert capacity.search(args, "trl")[0] == 2048
    # the start misses: halve to a fit (4096 -> 2048), then bisect up to the miss
    seen.clear()
    args.max_length = 131072
    args.start = 8192
    assert capacity.search(args, "trl")[0] == 2816
    assert seen == [8192, 4096, 2048, 3072, 2560, 2816]
    # nothing fits, down to 64 tokens
    seen.clear()
    monkeypatch.setattr(capacity, "probe", lambda a, p, n: dict(length=n, fits=False,
                                                                 peak_gib=9.0, status="ok"))
    length, probes = capacity.search(args, "trl")
    assert length is None and [p["length"] for p in probes][-1] == 64


@pytest.mark.slow
def test_one_real_probe_at_the_tiny_size():
    pytest.importorskip("trl")
    args = SimpleNamespace(num_generations=2, prompt_tokens=16, device="cpu", beta=0.0, seed=0,
                           num_layers=None, tiny=True, budget_gib=16.0)
    result = capacity.probe(args, "trl-kernels", 64)
    assert result["status"] == "ok" and result["fits"] and 0 < result["peak_gib"] < 16
    assert result["malloc"] == "MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072"
    args.budget_gib = 0.05  # below the process' own RSS: stopped, a miss
    result = capacity.probe(args, "trl-kernels", 64)
    assert not result["fits"] and result["status"].startswith("stopped")
