import pytest

from grpo_train.tiny import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 (hidden 32, 2 layers) saved for TRL to load."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny_model(str(path), hidden_size=32, num_layers=2)
    return str(path)
