"""grpo_kernels.trl.GRPOTrainer against TRL's own GRPOTrainer on a Mixture-of-Experts model (the
load-balancing auxiliary loss) and on a vision-language model (images through the model body),
both tiny and randomly initialized from a config, float32 on the CPU:

- one batch through both `_compute_loss` methods: the loss, the gradient of every parameter and
  the logged metrics (`aux_loss` included);
- the old/reference scoring in micro-batches (the aux loss, the images cut per micro-batch);
- three training steps (gradient accumulation 2, SGD): every logged number and the parameters
  at the end; no fallback warning from ours, and the aux loss must show in the result.
"""

import copy
import warnings

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
from datasets import Dataset  # noqa: E402
from trl_harness import DATASET, B, T, assert_same, make_trainer, run_both  # noqa: E402

from grpo_kernels import force_backend  # noqa: E402
from grpo_kernels.trl import GRPOTrainer  # noqa: E402
from grpo_train.tiny import build_tiny_model, build_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# Logged keys that are wall-clock times, not results
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second",
          "total_flos")


# ---- models and trainers -------------------------------------------------------------------

def save_tiny_moe(path, router_aux_loss_coef=0.1) -> None:
    """A tiny Qwen3-MoE (4 experts, 2 per token) and its tokenizer. TRL adds the aux loss for
    any config with an output_router_logits field and a coefficient != 0; the field stays False
    (its default, as in released MoE checkpoints): with True, transformers 5.24's Qwen3-MoE
    fails in generation with a cache (its aux loss pairs one step's router logits with the whole
    attention mask), in TRL's own trainer too."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=4, num_experts_per_tok=2, output_router_logits=False,
        router_aux_loss_coef=router_aux_loss_coef, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )).save_pretrained(path)
    tok.save_pretrained(path)


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# The tiny chat template of grpo_train.tiny, with Qwen2-VL's image placeholder
VLM_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


def build_processor():
    """A Qwen2-VL processor built offline: the tiny character tokenizer with Qwen2-VL's vision
    tokens, and an image processor that makes 2x2 patches of 14 pixels per image token.
    transformers checks a processor's video processor against a class that needs torchvision
    (not installed here), so the processor is declared without one (images only)."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template,
                             **kwargs)

    tok = build_tokenizer()
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    tok.chat_template = VLM_TEMPLATE
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 84)
    return ImageOnlyQwen2VLProcessor(image_processor=images, tokenizer=tok,
                                     chat_template=VLM_TEMPLATE)


def save_tiny_vlm(path, tok) -> None:
    """A tiny Qwen2-VL (a 1-layer vision tower, a 2-layer language model with mrope)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    start, end, image, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                             "rope_theta": 10000.0}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2),
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image,
        video_token_id=video,
    )).save_pretrained(path)


def image_dataset(n=8, multi=False):
    """TRL's VLM format: conversational prompts and an "image" column; random pixels in two
    sizes (16 and 24 patches of 14 pixels: 4 and 6 image tokens), so that micro-batches cut the
    patch rows unevenly. multi: an "images" column of one or two images per prompt instead."""
    from PIL import Image

    rng = np.random.RandomState(0)

    def image(i):
        return Image.fromarray(rng.randint(0, 256, (56, 56 + 28 * (i % 2), 3), dtype=np.uint8))

    prompts = [[{"role": "user", "content": f"{i}+{2 * i}"}] for i in range(n)]
    if multi:
        return Dataset.from_dict({"prompt": prompts, "images": [
            [image(i)] if i % 3 else [image(i), image(i + 1)] for i in range(n)]})
    return Dataset.from_dict({"prompt": prompts, "image": [image(i) for i in range(n)]})


def build_trainer(cls, model_dir, processing_class=None, dataset=DATASET, **overrides):
    """trl_harness.make_trainer with a processor and dataset of choice."""
    return make_trainer(cls, model_dir, processing_class=processing_class, dataset=dataset,
                        **overrides)


def train_both(model_dir, **kwargs):
    """TRL's trainer and ours after 3 SGD steps from the same seed; ours must warn nothing."""
    runs = []
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        trainer = build_trainer(cls, model_dir, max_steps=3, optim="sgd", learning_rate=0.1,
                                **kwargs)
        with force_backend("chunked"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        if cls is GRPOTrainer:
            ours_warned = [str(w.message) for w in caught if "grpo_kernels" in str(w.message)]
            assert ours_warned == [], ours_warned  # no fallback
        runs.append(trainer)
    return runs


def assert_same_run(ref, ours, model_dir):
    """Every logged number of the three steps and the parameters at the end agree; returns the
    largest differences seen (for the record)."""
    logs = [h for h in ref.state.log_history if "loss" in h]
    got_logs = [h for h in ours.state.log_history if "loss" in h]
    assert len(logs) == len(got_logs) == 3
    worst = {}
    for want, got in zip(logs, got_logs):
        assert got.keys() == want.keys()
        for k, v in want.items():
            if k in TIMING or not isinstance(v, (int, float)):
                continue
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6, nan_ok=True), (k, want["step"])
            worst[k] = max(worst.get(k, 0.0), abs(got[k] - v))
    init = build_trainer(trl.GRPOTrainer, model_dir,
                         processing_class=getattr(ref, "processing_class", None)).model
    moved = d_param = 0.0
    for (name, p0), p, q in zip(init.named_parameters(), ref.model.parameters(),
                                ours.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        moved = max(moved, (p - p0).abs().max().item())
        d_param = max(d_param, (p - q).abs().max().item())
    assert moved > 1e-3  # training did change the parameters
    worst["parameters"] = d_param
    return worst


# ---- Mixture of Experts --------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    save_tiny_moe(str(path))
    return str(path)


def test_hf_router_logits_give_the_models_own_aux_loss(moe_dir):
    """grpo_kernels.hf: the body's router logits (plain and through a wrapper's hook) and
    `load_balancing_loss` give the aux loss of the model's own forward, bit for bit."""
    from transformers import AutoModelForCausalLM

    from grpo_kernels.hf import completion_hidden_states, load_balancing_loss

    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 90, (3, 9), generator=g)
    am = torch.ones_like(ids)
    am[0, :2] = 0
    am[2, -3:] = 0
    own = model(input_ids=ids, attention_mask=am, output_router_logits=True).aux_loss
    plain = completion_hidden_states(model, ids, am, 4)
    wrapped = torch.nn.Module()  # a DDP-style `.module` wrapper: the body's output is hooked
    wrapped.module = model
    wrapped.forward = lambda **kw: model(**kw)
    for m in (model, wrapped):
        hidden, router_logits = completion_hidden_states(m, ids, am, 4,
                                                         return_router_logits=True)
        assert len(router_logits) == model.config.num_hidden_layers
        torch.testing.assert_close(hidden, plain, rtol=0, atol=0)
        torch.testing.assert_close(load_balancing_loss(m)(router_logits, am), own, rtol=0,
                                   atol=0)
    with pytest.raises(ValueError, match="no router logits"):
        load_balancing_loss(model)(None, am)
    dense = build_tiny_model(build_tokenizer(), hidden_size=32, num_layers=1)  # Qwen2, no MoE
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        completion_hidden_states(dense, ids, am, 4, return_router_logits=True)
    with pytest.raises(NotImplementedError, match="no load_balancing_loss_func"):
        load_balancing_loss(dense)


@pytest.mark.parametrize("cfg", [dict(loss_type="dapo", beta=0.04),
                                 dict(loss_type="grpo", entropy_coef=0.05)], ids=["dapo", "grpo"])
def test_moe_compute_loss_matches_trl(moe_dir, cfg):
    """Packed rows (MoE with TRL's aux loss on: shared rows would count each prompt once in it;
    the aux loss over their real tokens) and padded batches."""
    ref, ours, loss_ref, loss = run_both(moe_dir, **cfg)
    assert ref.aux_loss_enabled and ours._support.fallback is None and ours._layout == "packed"
    assert "aux_loss" in ours._metrics["train"]
    assert_same(ref, ours, loss_ref, loss)
    assert_same(*run_both(moe_dir, padding_free=False, **cfg))
    # eval mode: the aux loss is not divided by the accumulation steps there
    assert_same(*run_both(moe_dir, mode="eval", **cfg), mode="eval")


def test_moe_with_trl_loss_math_matches_trl(moe_dir):
    """A configuration GRPOParams refuses runs TRL's loss math on our scoring: the scoring then
    returns the aux loss TRL's _compute_loss adds."""
    with pytest.warns(UserWarning, match="rejects this configuration"):
        ref, ours, loss_ref, loss = run_both(moe_dir, loss_type="vespo", vespo_lambda_pos=0.0)
    assert "aux_loss" in ours._metrics["train"]
    assert_same(ref, ours, loss_ref, loss)


def test_moe_scoring_returns_the_aux_loss_of_trl(moe_dir):
    ref, ours = (build_trainer(c, moe_dir) for c in (trl.GRPOTrainer, GRPOTrainer))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 90, (5, 12), generator=g)
    am = torch.ones_like(ids)
    am[1, :3] = 0
    am[3, -2:] = 0
    with torch.no_grad(), force_backend("chunked"):
        want = ref._get_per_token_logps_and_entropies(ref.model, ids, am, T, batch_size=2,
                                                      compute_entropy=True, compute_aux_loss=True)
        got = ours._get_per_token_logps_and_entropies(ours.model, ids, am, T, batch_size=2,
                                                      compute_entropy=True, compute_aux_loss=True)
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-6)


def test_moe_training_run_matches_trl(moe_dir):
    ref, ours = train_both(moe_dir, loss_type="dapo", beta=0.04)
    worst = assert_same_run(ref, ours, moe_dir)
    assert "aux_loss" in ours.state.log_history[0]
    # the aux loss counts: without it (coefficient 0) the same run ends elsewhere
    without = build_trainer(GRPOTrainer, moe_dir, max_steps=3, optim="sgd", learning_rate=0.1,
                            loss_type="dapo", beta=0.04, router_aux_loss_coef=0.0)
    assert not without.aux_loss_enabled
    with force_backend("chunked"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        without.train()
    loss = [h["loss"] for h in ours.state.log_history if "loss" in h]
    loss_without = [h["loss"] for h in without.state.log_history if "loss" in h]
    assert abs(loss[0] - loss_without[0]) > 1e-3, (loss, loss_without)
    gate_moved = max((p - q).abs().max().item() for (n, p), q in zip(
        ours.model.named_parameters(), without.model.parameters()) if "gate" in n)
    assert gate_moved > 1e-4  # the aux loss has a gradient (TRL: the same to 1e-5, above)
    print("MoE run, largest |ours - TRL|:", worst)


# ---- vision-language model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_vl")
    processor = build_processor()
    save_tiny_vlm(str(path), processor.tokenizer)
    return str(path), processor


def vlm_batch(ref, multi, n=B):
    """A TRL VLM micro-batch from TRL's own generation step (pixel_values, image_grid_thw,
    num_images, mm_token_type_ids and the rest, as TRL's _compute_loss receives them)."""
    rows = list(image_dataset(n, multi))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = ref._generate_and_score_completions(rows)
    return batch


@pytest.mark.parametrize("multi", [False, True], ids=["one-image", "one-or-two-images"])
def test_vlm_compute_loss_and_scoring_match_trl(vlm, multi):
    model_dir, processor = vlm
    cfg = dict(loss_type="dapo", beta=0.04, entropy_coef=0.05)
    ref, ours = (build_trainer(cls, model_dir, copy.deepcopy(processor),
                               image_dataset(multi=multi), **cfg)
                 for cls in (trl.GRPOTrainer, GRPOTrainer))
    assert ours._support.fallback is None
    torch.manual_seed(0)
    inputs = vlm_batch(ref, multi)
    assert inputs["pixel_values"].shape[0] == inputs["image_grid_thw"].prod(-1).sum()
    assert len(set(inputs["num_images"])) == (2 if multi else 1)
    for tr in (ref, ours):
        tr.model.train()
        tr.current_gradient_accumulation_steps = 2
    # old log-probs of the generation step, disturbed so that ratios clip
    g = torch.Generator().manual_seed(1)
    old = inputs.get("old_per_token_logps")
    if old is not None:
        inputs["old_per_token_logps"] = old + 0.3 * torch.randn(old.shape, generator=g)
    loss_ref = ref._compute_loss(ref.model, inputs)
    loss_ref.backward()
    with force_backend("chunked"), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        loss = ours._compute_loss(ours.model, inputs)
        loss.backward()
    assert_same(ref, ours, loss_ref, loss)
    vision = [p.grad for n, p in ours.model.named_parameters() if "visual" in n]
    assert vision and all(gr is not None for gr in vision)  # the images reached the loss

    # scoring in micro-batches of 3 sequences: the patch rows cut as TRL cuts them
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    mm = {k: inputs[k] for k in ("pixel_values", "image_grid_thw", "num_images",
                                 "mm_token_type_ids") if k in inputs}
    Tc = inputs["completion_ids"].shape[1]
    with torch.no_grad(), force_backend("chunked"):
        want = ref._get_per_token_logps_and_entropies(ref.model, ids, am, Tc, batch_size=3,
                                                      compute_entropy=True, **mm)
        got = ours._get_per_token_logps_and_entropies(ours.model, ids, am, Tc, batch_size=3,
                                                      compute_entropy=True, **mm)
        text_only = ours._get_per_token_logps_and_entropies(ours.model, ids, am, Tc)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert got[2] is None
    assert (text_only[0] - got[0]).abs().max() > 1e-3  # the images change the log-probs


def test_vlm_training_run_matches_trl(vlm):
    model_dir, processor = vlm
    ref, ours = train_both(model_dir, processing_class=copy.deepcopy(processor),
                           dataset=image_dataset(), loss_type="dapo", beta=0.04)
    worst = assert_same_run(ref, ours, model_dir)
    print("VLM run, largest |ours - TRL|:", worst)
