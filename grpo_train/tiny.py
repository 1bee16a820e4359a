"""A tiny causal LM and a character-level tokenizer, built locally (no downloads).

Used by the embedded default task, by the tests (saved to a temporary directory and loaded back
through the Auto classes) and by the examples.
"""

from __future__ import annotations

import string

import torch

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
# One token per printable ASCII character (newline and space included), plus the tags above.
CHARACTERS = list(string.digits + string.ascii_letters + string.punctuation + " \n")

# User turns are concatenated and the assistant's turn opens with "="; chosen so that the
# embedded arithmetic task reads "12+30=" and answers "42<eos>".
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


def build_tokenizer(vocab_size: int | None = None):
    """A character-level `PreTrainedTokenizerFast` with pad/eos/bos/unk, tag tokens and a chat
    template; round-trips through save_pretrained / AutoTokenizer.from_pretrained.

    `vocab_size` pads the vocabulary with filler tokens "<|t123|>" (never produced by encoding,
    decodable), so that a model with a real-model vocabulary (benchmarks: 151,936) can sample
    any id and have it decoded."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIAL_TOKENS + TAG_TOKENS + CHARACTERS
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size must be >= {len(tokens)}, got {vocab_size}")
        tokens = tokens + [f"<|t{i}|>" for i in range(len(tokens), vocab_size)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # tags are single tokens; everything else splits into characters
    tag_pattern = "|".join(t.replace("/", "\\/") for t in TAG_TOKENS)
    core.pre_tokenizer = pre_tokenizers.Split(Regex(f"{tag_pattern}|."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
        unk_token="<unk>", padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(
    tokenizer,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 256,
    seed: int = 0,
    initializer_range: float = 0.02,
):
    """A randomly initialised Qwen2 or Llama causal LM sized for a CPU, matched to `tokenizer`;
    `initializer_range` is the weights' standard deviation (transformers' default 0.02)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    config_cls, model_cls = classes[arch]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        initializer_range=initializer_range,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny_model(path, arch: str = "qwen2", **model_kwargs) -> None:
    """Write a tiny random model and its tokenizer to `path` (loadable with the Auto classes)."""
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, arch=arch, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
