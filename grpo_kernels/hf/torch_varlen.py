"""PyTorch's own variable-length FlashAttention as a transformers attention implementation.

`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, CUDA) runs the FlashAttention kernels
bundled with PyTorch on sequences laid end to end, given their boundaries (cu_seq_lens) and the
longest length. `register()` makes it available to transformers under the name
"torch_varlen_flash", so packed rows run a real flash varlen kernel without the flash_attn
package (set the name on the loaded model's config: some transformers releases look names with
"flash" in them up as Hub kernels when a config is built with one):

    from grpo_kernels.hf import torch_varlen
    model.config._attn_implementation = torch_varlen.register()  # "torch_varlen_flash"

The name contains "flash", so `choose_row_width` lays packed rows as one row and grpo_train
hands the model the boundaries explicitly (`PackedBatch.boundaries`: cu_seq_lens_q/k,
max_length_q/k), which transformers passes through to the attention function. Without them
(a plain forward) each row is one causal sequence; a padded batch is refused (this
implementation reads no mask, and a mask with padding reaches it and raises).
"""

from __future__ import annotations

import inspect

import torch

NAME = "torch_varlen_flash"


def _keywords(varlen_attn, scaling, head_dim: int) -> dict:
    """The keywords that make varlen_attn causal (and scaled by `scaling`) in this torch."""
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:  # (-1, 0): every earlier key, none after
        out = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        out = {"is_causal": True}
    else:
        raise RuntimeError(f"torch {torch.__version__}'s varlen_attn has no causal option "
                           f"(parameters: {list(params)})")
    if "scale" in params:
        out["scale"] = scaling
    elif scaling is not None and abs(scaling - head_dim ** -0.5) > 1e-12:
        raise RuntimeError(f"torch {torch.__version__}'s varlen_attn takes no scale; the model "
                           f"scales by {scaling}, not 1/sqrt({head_dim})")
    return out


def varlen_flash_attention(module, query, key, value, attention_mask, scaling=None,
                           dropout=0.0, **kwargs):
    """transformers' attention contract: query [B, H, L, D], key/value [B, Hkv, L, D] ->
    ([B, L, H, D], None). Boundaries: cu_seq_lens_q/k [S + 1] and max_length_q/k over the
    flattened B·L positions (kwargs), else one sequence per row."""
    from torch.nn.attention.varlen import varlen_attn

    if attention_mask is not None:
        raise ValueError(f"{NAME} reads no attention mask: pass packed rows (attention_mask "
                         "None, position_ids restarting per sequence, and the boundaries)")
    if dropout:
        raise ValueError(f"{NAME} has no attention dropout; got dropout={dropout}")
    B, H, L, D = query.shape
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None:  # one causal sequence per row
        cu_q = cu_k = torch.arange(0, (B + 1) * L, L, device=query.device, dtype=torch.int32)
        max_q = max_k = L
    else:
        max_q, max_k = int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
    query, key, value = _autocast_inputs(query, key, value)
    if key.shape[1] != H:  # grouped-query attention: repeat the key/value heads
        key = key.repeat_interleave(H // key.shape[1], dim=1)
        value = value.repeat_interleave(H // value.shape[1], dim=1)
    q, k, v = (x.transpose(1, 2).reshape(B * L, H, D) for x in (query, key, value))
    out = varlen_attn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
                      **_keywords(varlen_attn, scaling, D))
    return out.reshape(B, L, H, D), None


def _autocast_inputs(query, key, value):
    """q, k, v in the autocast dtype where autocast is on and one of them is float32: with
    float32 weights under bf16 autocast, the projections give bf16 but rotary embeddings
    (cos/sin in the residual stream's float32) promote q and k back to float32, and the flash
    kernels take 16-bit inputs only (sdpa is cast by autocast itself; this custom op is not)."""
    device = query.device.type
    if not torch.is_autocast_enabled(device):
        return query, key, value
    dtype = torch.get_autocast_dtype(device)
    if all(x.dtype == dtype for x in (query, key, value)):
        return query, key, value
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in (query, key, value))


def register() -> str:
    """Register `varlen_flash_attention` with transformers as NAME, with transformers' flash
    mask function (a padded batch's 2-D mask then reaches the attention function, which refuses
    it, instead of being dropped); returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(NAME, varlen_flash_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)
    return NAME
