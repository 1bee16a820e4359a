"""grpo_kernels.trl.compat: a TRL whose GRPOTrainer lacks or changed a method or attribute that
the subclass uses is refused when the trainer is built, with a message that names the TRL
version and the method or attribute. Stand-in classes, no model: fast. Also: the loss
hyperparameters' defaults are TRL's GRPOConfig defaults."""

import dataclasses
import importlib.util
import inspect
import sys
import textwrap

import pytest
from trl import GRPOConfig

from grpo_kernels.params import FIELD_NAMES, GRPOParams
from grpo_kernels.trl import compat


def method(names):
    """A function whose signature is (self, *names), the later ones keywords with defaults."""
    def fn(self, *args, **kwargs):
        return None

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                 default=None if i >= 4 else inspect.Parameter.empty)
               for i, n in enumerate(names)]
    fn.__signature__ = inspect.Signature(params)
    return fn


def stand_in(**changes):
    """A class with TRL 1.16's overridden methods; changes: name -> parameter names, or None to
    leave the method out."""
    body = {name: method(params) for name, params in compat.METHODS.items()}
    for name, params in changes.items():
        if params is None:
            del body[name]
        else:
            body[name] = method(params)
    return type("StandInGRPOTrainer", (), body)


def test_tested_shapes_pass():
    compat.check_methods(stand_in(), "1.16.0")


def test_a_missing_method_is_named_with_the_version():
    with pytest.raises(compat.TRLCompatibilityError) as err:
        compat.check_methods(stand_in(_compute_loss=None), "9.1.0")
    message = str(err.value)
    assert "TRL 9.1.0 has no method StandInGRPOTrainer._compute_loss" in message, message
    assert "trl>=1.16,<1.17" in message


def test_a_changed_signature_is_named_with_the_version():
    params = compat.METHODS["_get_per_token_logps_and_entropies"] + ("video_grid_thw",)
    with pytest.raises(compat.TRLCompatibilityError) as err:
        compat.check_methods(stand_in(_get_per_token_logps_and_entropies=params), "9.1.0")
    message = str(err.value)
    assert ("TRL 9.1.0 changed the signature of "
            "StandInGRPOTrainer._get_per_token_logps_and_entropies") in message, message
    assert "video_grid_thw" in message


def test_a_renamed_parameter_fails():
    with pytest.raises(compat.TRLCompatibilityError, match=r"_compute_loss: it takes \(model, "
                       r"batch\), expected \(model, inputs\)"):
        compat.check_methods(stand_in(_compute_loss=("model", "batch")), "9.1.0")


def load_module(tmp_path, source):
    """A module from source in a file (the training-loop check reads its classes' source)."""
    path = tmp_path / "standin_trainer.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location("standin_trainer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


TRAINER_SOURCE = """
    class Config:
        cast_lm_head_to_fp32 = False
        steps_per_generation = 2
        delta = None
        sapo_temperature_pos = 1.0
        sapo_temperature_neg = 1.05
        use_bias_correction_kl = False
        vespo_k_pos = vespo_lambda_pos = vespo_k_neg = vespo_lambda_neg = 2.0
        entropy_target = entropy_coef_delta = entropy_coef_min = entropy_coef_max = 0.0

    class Trainer:
        def __init__(self, attributes):
            for name in attributes:
                setattr(self, name, None)
            self.args = Config()
            for name in ("beta", "epsilon_low", "epsilon_high", "importance_sampling_level",
                         "max_completion_length", "temperature", "loss_type"):
                setattr(self, name, None)
    {loop}
"""
LOOP = """
        def training_step(self):
            self.current_gradient_accumulation_steps = 1
"""


@pytest.fixture
def standin_module(tmp_path):
    yield load_module(tmp_path, TRAINER_SOURCE.format(loop=LOOP))
    sys.modules.pop("standin_trainer", None)


def test_attributes_as_tested_pass(standin_module):
    compat.check_attributes(standin_module.Trainer(compat.TRAINER_ATTRIBUTES), "1.16.0")


def test_a_missing_attribute_is_named_with_the_version(standin_module):
    attributes = [a for a in compat.TRAINER_ATTRIBUTES if a != "use_vllm"]
    with pytest.raises(compat.TRLCompatibilityError,
                       match=r"TRL 9\.1\.0 no longer sets the attribute Trainer\.use_vllm"):
        compat.check_attributes(standin_module.Trainer(attributes), "9.1.0")


def test_a_missing_loss_hyperparameter_is_named(standin_module):
    del standin_module.Config.delta  # GRPOParams.from_config would default it silently
    with pytest.raises(compat.TRLCompatibilityError, match=r"neither Trainer\.delta nor the "
                       r"config field Config\.delta"):
        compat.check_attributes(standin_module.Trainer(compat.TRAINER_ATTRIBUTES), "9.1.0")


def test_a_training_loop_attribute_nobody_sets_is_named(tmp_path):
    module = load_module(tmp_path, TRAINER_SOURCE.format(loop=""))
    try:
        with pytest.raises(compat.TRLCompatibilityError, match=r"no longer sets "
                           r"Trainer\.current_gradient_accumulation_steps in its training loop"):
            compat.check_attributes(module.Trainer(compat.TRAINER_ATTRIBUTES), "9.1.0")
    finally:
        sys.modules.pop("standin_trainer", None)


def test_methods_are_checked_before_the_constructor_runs():
    entered = []
    with pytest.raises(compat.TRLCompatibilityError):
        with compat.trl_checked(object(), stand_in(_compute_loss=None)):
            entered.append(True)
    assert entered == []


# ---- the installed TRL ---------------------------------------------------------------------

def test_installed_trl_has_the_tested_methods():
    pytest.importorskip("trl")
    from grpo_kernels.trl import trainer

    compat.check_methods(trainer._TRLGRPOTrainer)
    # the multimodal keywords of the scoring method are the ones the trainer passes on
    scoring = compat.METHODS["_get_per_token_logps_and_entropies"]
    assert set(scoring[7:]) == set(trainer.MULTIMODAL_KEYS)


def test_the_trainer_checks_before_loading_the_model(monkeypatch):
    pytest.importorskip("trl")
    from grpo_kernels.trl import GRPOTrainer

    monkeypatch.setitem(compat.METHODS, "_compute_loss", ("model", "inputs", "extra"))
    with pytest.raises(compat.TRLCompatibilityError, match=r"GRPOTrainer\._compute_loss"):
        GRPOTrainer(model="/nonexistent/model")


# GRPOParams fields whose GRPOConfig namesake has another default, and why
NOT_TRLS_DEFAULT = {
    # dr_grpo's normalizer only: None makes dr_grpo without it an error instead of a silent
    # 512 (the TRL subclass reads the trainer's value)
    "max_completion_length",
}


@pytest.mark.parametrize("field", [
    name for name in FIELD_NAMES if name not in NOT_TRLS_DEFAULT])
def test_loss_defaults_are_trls(field):
    """Each GRPOParams default is the default of TRL 1.16's GRPOConfig field of that name
    (epsilon_low is TRL's epsilon): a loss called without a setting computes what TRL's
    trainer computes without it."""
    config = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    ours = {f.name: f.default for f in dataclasses.fields(GRPOParams)}
    trl_name = {"epsilon_low": "epsilon"}.get(field, field)
    assert trl_name in config, f"GRPOConfig has no field {trl_name}"
    assert ours[field] == config[trl_name], (field, ours[field], config[trl_name])
