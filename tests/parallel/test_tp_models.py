"""Hugging Face models under transformers' tensor parallelism (tp_plan="auto", torchrun with two
CPU processes, gloo; `tp_model_worker.py`): the helpers take the DTensor head as it is, never
run the model's gathering head after the once-per-model check, and give the loss, metrics,
log-probs and every parameter's gradient of the same model loaded whole, padded and packed,
with a tied and an untied head."""

import json
from pathlib import Path

import pytest
from mp_launch import torchrun

from grpo_train.tiny import save_tiny_model

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow  # two processes, about half a minute


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    dirs = []
    for tied in (True, False):
        path = root / ("tied" if tied else "untied")
        save_tiny_model(path, hidden_size=32, num_layers=1, tie_word_embeddings=tied)
        dirs.append(str(path))
    torchrun(HERE / "tp_model_worker.py", 2, str(root), *dirs, timeout=300, interpreter=False)
    return [json.loads((root / f"hf-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("model", ["tied", "untied"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_tensor_parallel_model_equals_whole_model(results, model, layout):
    for rank in (0, 1):
        r = results[rank][model]
        assert r["head"] == "DTensor" and r["placements"] == "(Shard(dim=0),)"
        assert r["head_calls"] == 0  # the model's own (gathering) head never ran
        got = r[layout]
        assert got["loss"] <= 1e-6 * max(1.0, abs(got["loss_value"]))
        assert got["metrics"] <= 1e-5 and got["logp"] <= 1e-5
        for name, rel in got["grads"].items():
            assert rel <= 1e-5, (rank, name, rel)
    assert results[0][model][layout]["rank_loss"] == results[1][model][layout]["rank_loss"]
