"""grpo_kernels.trl.GRPOTrainer reached through TRL's own names.

Training frameworks patch TRL with `trl.GRPOTrainer = grpo_kernels.trl.GRPOTrainer` (and
trl.trainer.GRPOTrainer) and construct `trl.GRPOTrainer`. Nothing may depend on those names:
- a PEFT LoRA adapter on lm_head trains exactly as with `from grpo_kernels.trl import
  GRPOTrainer` (TRL's refusal of it stays lifted, and is restored after the constructor);
- the float32 head (cast_lm_head_to_fp32) gives the same loss and gradients;
- the fallback warnings name the caller's line (this file), once, through a direct call and
  through Trainer.train, either way in.
"""

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
from test_trl import make_batch, make_trainer, save_unknown_transform_model  # noqa: E402  (tiny offline models, TRL batches)

from grpo_kernels import force_backend  # noqa: E402
from grpo_kernels.trl import GRPOTrainer  # noqa: E402
from grpo_train.tiny import save_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TRL_MODULE = trl.trainer.grpo_trainer  # where TRL's lm_head adapter check lives
REBOUND = ("trl.GRPOTrainer", "trl.trainer.GRPOTrainer")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny_model(str(path), hidden_size=32, num_layers=2)
    return str(path)


@pytest.fixture(scope="module")
def unknown_transform_dir(tmp_path_factory):
    """A model whose logits the fused path cannot reproduce: TRL's implementation runs for it
    (with a warning)."""
    path = tmp_path_factory.mktemp("tiny_unknown_transform")
    save_unknown_transform_model(path)
    return str(path)


def rebind(monkeypatch, name: str):
    """Patch TRL as training frameworks do; the class that `name` now gives."""
    monkeypatch.setattr(trl, "GRPOTrainer", GRPOTrainer)
    monkeypatch.setattr(trl.trainer, "GRPOTrainer", GRPOTrainer)
    cls = trl.GRPOTrainer if name == "trl.GRPOTrainer" else trl.trainer.GRPOTrainer
    assert cls is GRPOTrainer
    return cls


def loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    with force_backend("chunked"):
        loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss, {n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad}


def assert_same_step(by_name, rebound, inputs):
    """The same loss and gradients, bit for bit (the same code on the same numbers)."""
    rebound.model.load_state_dict(by_name.model.state_dict())
    loss, grads = loss_and_grads(by_name, inputs)
    loss_rebound, grads_rebound = loss_and_grads(rebound, inputs)
    torch.testing.assert_close(loss_rebound, loss, rtol=0, atol=0)
    assert grads_rebound.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_rebound[name], grad, rtol=0, atol=0,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")
    return grads


@pytest.mark.parametrize("name", REBOUND)
def test_lora_head_trains_as_with_the_import_by_name(model_dir, monkeypatch, name):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"],
                           init_lora_weights=False)
    cfg = dict(peft_config=lora, loss_type="dapo", beta=0.04, entropy_coef=0.05)
    by_name = make_trainer(GRPOTrainer, model_dir, **cfg)
    inputs = make_batch(by_name)  # before the rebinding: scored by TRL's own class
    rebound = make_trainer(rebind(monkeypatch, name), model_dir, **cfg)
    assert type(rebound) is GRPOTrainer
    # TRL's check is lifted for the constructor only
    assert TRL_MODULE.BaseTunerLayer is peft.tuners.tuners_utils.BaseTunerLayer
    grads = assert_same_step(by_name, rebound, inputs)
    head = [n for n in grads if "lm_head.lora_" in n]
    assert len(head) == 2
    for n in head:  # the head's adapter is trained
        assert grads[n].abs().sum() > 0, n


@pytest.mark.parametrize("name", REBOUND)
def test_fp32_head_as_with_the_import_by_name(model_dir, monkeypatch, name):
    cfg = dict(loss_type="dapo", beta=0.04, cast_lm_head_to_fp32=True,
               model_init_kwargs={"dtype": "bfloat16"})
    by_name = make_trainer(GRPOTrainer, model_dir, **cfg)
    inputs = make_batch(by_name)
    cls = rebind(monkeypatch, name)
    rebound = make_trainer(cls, model_dir, **cfg)
    for trainer in (by_name, rebound):
        assert trainer.model.get_output_embeddings().weight.dtype == torch.float32
        assert trainer._head_dtype == torch.float32
    assert_same_step(by_name, rebound, inputs)
    peft = pytest.importorskip("peft")
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32=True cannot be combined"):
        make_trainer(cls, model_dir, peft_config=peft.LoraConfig(r=2, target_modules=["lm_head"]),
                     cast_lm_head_to_fp32=True)


def fallback_warning(record, instead: str):
    """The one grpo-kernels fallback warning among those recorded; it says once what runs
    instead (`instead`), and names this file's line."""
    (w,) = [w for w in record if str(w.message).startswith("grpo_kernels.trl.GRPOTrainer:")]
    assert w.filename == __file__, (w.filename, str(w.message))
    assert instead in str(w.message) and str(w.message).count("instead") == 1, w.message


@pytest.mark.parametrize("way", ("by name", *REBOUND))
def test_fallback_warning_names_the_callers_line(model_dir, monkeypatch, way):
    cls = GRPOTrainer if way == "by name" else rebind(monkeypatch, way)
    # TRL floors vespo's λ at 1e-4; GRPOParams refuses λ <= 0, so the loss falls back to TRL's
    trainer = make_trainer(cls, model_dir, loss_type="vespo", vespo_lambda_pos=0.0)
    inputs = make_batch(trainer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    with pytest.warns(UserWarning, match="vespo_lambda_pos") as record, force_backend("chunked"):
        trainer._compute_loss(trainer.model, inputs)
    fallback_warning(record, "TRL's loss math runs instead")


@pytest.mark.parametrize("way", ("by name", "trl.GRPOTrainer"))
def test_fallback_warning_in_training_names_the_train_call(model_dir, unknown_transform_dir,
                                                          monkeypatch, way):
    """Through Trainer.train: the loss fallback (training_step -> compute_loss -> _compute_loss)
    and the model fallback (first met in old-policy scoring during generation)."""
    cls = GRPOTrainer if way == "by name" else rebind(monkeypatch, way)
    runs = ((model_dir, dict(loss_type="vespo", vespo_lambda_neg=0.0), "vespo_lambda_neg",
             "TRL's loss math runs instead"),
            (unknown_transform_dir, {}, "logits are not those",
             "TRL's own implementation runs instead"))
    for directory, cfg, reason, instead in runs:
        trainer = make_trainer(cls, directory, **cfg)  # 2 steps, 4 micro-batches
        with pytest.warns(UserWarning, match=reason) as record, force_backend("chunked"):
            trainer.train()
        fallback_warning(record, instead)  # once for the run
