"""The cost of a packed row's width under a dense-mask attention implementation (sdpa, eager).

With packed rows, sdpa and eager attention take a dense [R, 1, W, W] mask built from the
position_ids restarts, so a row of width W spends work on all W² position pairs, not only on the
pairs inside its sequences. A forward + backward of one decoder layer over R rows of W positions
then costs about

    t = a·(R·W) + b·(R·W²)    (a: a position's dense work, b: a position pair's attention)

and the packing planner (`grpo_kernels.hf.choose_row_width`) chooses W by the ratio
b / a. This module measures a and b on the current machine: one layer of a Qwen2.5-0.5B-shaped
model (float32, random weights) at a fixed number of positions P = R·W, for several widths, and
fits t = a·P + b·P·W by least squares.

    python -m benchmarks.row_cost                   # the Qwen2.5-0.5B shape, sdpa, P = 4096
    python -m benchmarks.row_cost --attn eager --positions 2048 --repeats 5

It prints each width's median time and the fitted a, b and b / a (in positions: a pair costs
b / a positions' dense work).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch


def layer_time(layer, rotary, rows: int, width: int, hidden: int, repeats: int,
               device: torch.device) -> float:
    """Median seconds of forward + backward of `layer` over rows [rows, width] of packed
    sequences (each row holds 4 equal sequences, so the mask is a real block diagonal)."""
    from transformers.masking_utils import create_causal_mask

    x = torch.randn(rows, width, hidden, device=device, requires_grad=True)
    seq = max(1, width // 4)
    pos = (torch.arange(width, device=device) % seq).expand(rows, width)
    no_cache = {"cache" if "cache" in inspect.signature(create_causal_mask).parameters
                else "past_key_values": None}  # renamed in transformers 5.x
    mask = create_causal_mask(config=layer.self_attn.config, inputs_embeds=x,
                              attention_mask=None, position_ids=pos, **no_cache)
    emb = rotary(x, pos)
    times = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(repeats + 1):
        sync()
        start = time.perf_counter()
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=emb)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
        sync()
        if i:  # the first run warms up
            times.append(time.perf_counter() - start)
        x.grad = None
    return statistics.median(times)


def fit(points: list[tuple[int, float]], positions: int) -> tuple[float, float]:
    """(a, b) of t = a·P + b·P·W, least squares over (W, t) points at fixed P."""
    X = torch.tensor([[positions, positions * w] for w, _ in points], dtype=torch.float64)
    y = torch.tensor([t for _, t in points], dtype=torch.float64)
    a, b = torch.linalg.lstsq(X, y.unsqueeze(1)).solution.squeeze(1).tolist()
    return a, b


def main(argv=None) -> dict:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    from benchmarks.trainer_step import QWEN25_05B

    parser = argparse.ArgumentParser("python -m benchmarks.row_cost", description=__doc__)
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--positions", type=int, default=4096, help="P = R·W (fixed)")
    parser.add_argument("--widths", default="256,512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN25_05B)
    config._attn_implementation = args.attn
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.set_default_dtype(dtype)
    layer = Qwen2DecoderLayer(config, layer_idx=0).to(device)
    rotary = Qwen2RotaryEmbedding(config).to(device)
    points = []
    for width in (int(w) for w in args.widths.split(",")):
        if args.positions % width:
            raise SystemExit(f"--positions {args.positions} must be a multiple of each width")
        t = layer_time(layer, rotary, args.positions // width, width, config.hidden_size,
                       args.repeats, device)
        points.append((width, t))
        print(f"W={width:6d} rows={args.positions // width:4d}  {t * 1e3:9.1f} ms", flush=True)
    a, b = fit(points, args.positions)
    print(f"a = {a:.3e} s per position, b = {b:.3e} s per pair, b/a = {b / a:.3e} "
          f"({args.attn}, {args.device} {args.dtype}, {torch.get_num_threads()} threads, "
          f"P = {args.positions})")
    return {"a": a, "b": b, "ratio": b / a, "points": points}


if __name__ == "__main__":
    main()
