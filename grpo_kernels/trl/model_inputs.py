"""What the TRL subclass gives the model body besides input_ids and attention_mask, and what it
takes from its output besides the hidden states: vision-language inputs and the MoE auxiliary
loss (a mixin of `grpo_kernels.trl.GRPOTrainer`).

- Vision-language models: TRL 1.16 calls the body (`model.base_model`, through its fused head)
  with the batch's pixel_values, image_grid_thw, ... cut to each micro-batch of sequences
  (`multimodal_inputs`, TRL's slicing); so does the subclass, and the body merges the image
  features into the sequence and computes its positions (Qwen2-VL's rope indices) itself. The
  hidden states of the completion positions go to the fused head as for a text model.
- Mixture-of-Experts models (TRL's `aux_loss_enabled`): the body runs with
  output_router_logits=True and the load-balancing loss is the model's own
  (`grpo_kernels.hf.load_balancing_loss`), on the body's router logits and the micro-batch's
  attention mask; it is added as TRL adds it (`router_aux_loss_coef` · aux / accumulation
  steps) and logged as `aux_loss`.
"""

from __future__ import annotations

import torch

from ..hf import completion_hidden_states, hidden_logprobs
from ..hf.packed_rows import completion_targets

# The multimodal keywords of TRL 1.16's scoring method (and batch keys of its VLM batches)
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                   "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                   "mm_token_type_ids", "image_position_ids")


def multimodal_inputs(start: int, end: int, pixel_values=None, image_grid_thw=None,
                      num_images=None, pixel_attention_mask=None, spatial_shapes=None,
                      num_tiles=None, image_sizes=None, token_type_ids=None,
                      mm_token_type_ids=None, image_position_ids=None) -> dict:
    """The model inputs of sequences [start, end) of the batch, as TRL 1.16's
    `_get_per_token_logps_and_entropies` cuts them: image rows by image_grid_thw (Qwen-VL),
    images by num_images, tiles by num_tiles (LFM2-VL, InternVL), per-sequence tensors by row."""
    out = {}
    if num_images is not None:
        cum_imgs = torch.tensor([0] + list(num_images)).cumsum(0)
        img_start, img_end = cum_imgs[start], cum_imgs[end]
    if image_grid_thw is not None and pixel_values is not None:
        rows_per_sample = torch.stack(
            [s.sum() for s in torch.split(image_grid_thw.prod(dim=-1), list(num_images))])
        cum_rows = torch.cat([rows_per_sample.new_zeros(1), rows_per_sample.cumsum(0)])
        out["pixel_values"] = pixel_values[cum_rows[start].item():cum_rows[end].item()]
        out["image_grid_thw"] = image_grid_thw[img_start:img_end]
    elif image_position_ids is not None and pixel_values is not None:
        out["pixel_values"] = pixel_values[img_start:img_end]
        out["image_position_ids"] = image_position_ids[img_start:img_end]
    elif spatial_shapes is not None and pixel_values is not None:  # LFM2-VL: tile-indexed
        cum_tiles = torch.tensor([0] + list(num_tiles)).cumsum(0)
        tile_start, tile_end = cum_tiles[start], cum_tiles[end]
        out["pixel_values"] = pixel_values[tile_start:tile_end]
        out["pixel_attention_mask"] = pixel_attention_mask[tile_start:tile_end]
        out["spatial_shapes"] = spatial_shapes[tile_start:tile_end]
    elif num_tiles is not None and pixel_values is not None:  # InternVL: tile-indexed
        cum_tiles = torch.tensor([0] + list(num_tiles)).cumsum(0)
        out["pixel_values"] = pixel_values[cum_tiles[start]:cum_tiles[end]]
    elif (pixel_values is not None and num_images is not None
          and pixel_values.size(0) == sum(num_images)):
        out["pixel_values"] = pixel_values[img_start:img_end]
    elif pixel_values is not None:
        out["pixel_values"] = pixel_values[start:end]
    if pixel_attention_mask is not None and spatial_shapes is None:
        out["pixel_attention_mask"] = pixel_attention_mask[start:end]
    if image_sizes is not None:
        out["image_sizes"] = image_sizes[img_start:img_end]
    if token_type_ids is not None:
        out["token_type_ids"] = token_type_ids[start:end]
    if mm_token_type_ids is not None:
        out["mm_token_type_ids"] = mm_token_type_ids[start:end]
    return out


class ModelInputs:
    """The body's extra inputs and outputs (mixed into the TRL subclass); reads TRL's attributes
    router_aux_loss_coef, accelerator, temperature, _metrics, and the subclass's _support
    (`model_support.ModelSupport`: the bound MoE loss) and _head_dtype."""

    def _body_hidden(self, model, input_ids, attention_mask, logits_to_keep, multimodal: dict,
                     compute_aux_loss: bool, start: int = 0, end: int | None = None):
        """(hidden [b, T, D] of sequences [start, end), their aux loss or None)."""
        end = input_ids.shape[0] if end is None else end
        ids, am = input_ids[start:end], attention_mask[start:end]
        extra = multimodal_inputs(start, end, **multimodal) if multimodal else {}
        out = completion_hidden_states(model, ids, am, logits_to_keep,
                                       return_router_logits=compute_aux_loss, **extra)
        if not compute_aux_loss:
            return out, None
        hidden, router_logits = out
        return hidden, self._support.aux_loss(router_logits, am)

    def _score_model_inputs(self, model, input_ids, attention_mask, logits_to_keep, batch_size,
                            compute_entropy: bool, compute_aux_loss: bool, multimodal: dict):
        """TRL's scoring return (logps, entropies | None, aux | None) of a batch with images or
        an aux loss, in TRL's micro-batches of `batch_size` sequences."""
        B = input_ids.shape[0]
        step = batch_size or B
        logps, ents, auxes = [], [], []
        for start in range(0, B, step):
            end = min(start + step, B)
            ids = completion_targets(input_ids[start:end], logits_to_keep)
            with self.accelerator.autocast():  # the head's dtype follows autocast, as TRL's
                hidden, aux = self._body_hidden(model, input_ids, attention_mask, logits_to_keep,
                                                multimodal, compute_aux_loss, start, end)
                out = hidden_logprobs(hidden, model, ids, temperature=self.temperature,
                                      return_entropy=compute_entropy, head_dtype=self._head_dtype)
            logps.append(out[0] if compute_entropy else out)
            ents.append(out[1] if compute_entropy else None)
            auxes.append(aux)
        valid = attention_mask[:, -logits_to_keep:].to(logps[0].device, logps[0].dtype)
        logp = torch.cat(logps) * valid
        ent = torch.cat(ents) * valid if compute_entropy else None
        return logp, ent, torch.stack(auxes).mean() if compute_aux_loss else None

    def _add_aux_loss(self, loss, aux, mode: str):
        """TRL's `loss + router_aux_loss_coef · aux / accumulation steps`, logging `aux_loss`."""
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss + self.router_aux_loss_coef * aux / normalizer
        self._metrics[mode]["aux_loss"].append(
            self.accelerator.gather_for_metrics(aux).mean().item())
        return loss
