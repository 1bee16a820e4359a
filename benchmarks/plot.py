"""Comparison plot from result rows: time vs N and peak memory vs N, per provider and head.

    python -m benchmarks.plot benchmarks/results/<device>.csv --out bench.png [--mode fwd+bwd]

One row of two panels per kernel (fused linear, logits): median ms vs N (log-log) and "peak
above inputs+grads" MiB vs N. Colour = provider, marker = head. On the fused-linear memory panel
a dashed grey line per head shows the size of ONE bf16 [N, V] logits tensor: a provider whose
memory follows those lines has an N×V term, one that stays flat below them does not. For every
(kernel, provider, head, N) the latest "ok" row in the file is drawn, so repeated runs refine the
figure instead of duplicating it. matplotlib is imported lazily (only this module needs it).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

# Colour per provider (providers.NAMES); ours' variants in blues and purples, its four-pass
# route dashed, so that the two routes of one call read as a pair.
COLORS = {"ours": "tab:blue", "ours-4pass": "tab:cyan", "ours-atomic": "tab:purple",
          "ours-filter": "tab:pink", "trl": "tab:brown", "cce": "tab:olive",
          "cce-filter": "darkkhaki", "liger": "tab:green", "reference": "tab:red",
          "reference-compile": "tab:orange"}
DASHED = {"ours-4pass", "ours-atomic", "ours-filter", "cce-filter"}
MARKERS = ["o", "s", "^", "D", "v", "P"]


def _float(x) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def latest_ok(rows: Sequence[dict], mode: str) -> dict[tuple, dict]:
    """(kernel, provider, head, N) -> the last ok row of `mode` (file order = time order)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if r.get("mode") != mode or r.get("status") != "ok" or r.get("kernel") == "ceiling":
            continue
        out[(r["kernel"], r["provider"], r["head"], int(r["n_tokens"]))] = r
    return out


def plot(rows: Sequence[dict], out: Path | str, mode: str = "fwd+bwd",
         title: str | None = None) -> Path | None:
    """Writes the PNG and returns its path (None when no row of `mode` is ok)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = latest_ok(rows, mode)
    if not data:
        return None
    kernels = [k for k in ("fused_linear", "logits") if any(key[0] == k for key in data)]
    heads = sorted({key[2] for key in data})
    marker = {h: MARKERS[i % len(MARKERS)] for i, h in enumerate(heads)}
    fig, axes = plt.subplots(len(kernels), 2, figsize=(12, 4.2 * len(kernels)), squeeze=False)
    for row_axes, kernel in zip(axes, kernels):
        ax_t, ax_m = row_axes
        series = sorted({(p, h) for (k, p, h, _) in data if k == kernel})
        for provider, head in series:
            pts = sorted((n, r) for (k, p, h, n), r in data.items()
                         if (k, p, h) == (kernel, provider, head))
            ns = [n for n, _ in pts]
            style = dict(color=COLORS.get(provider, "black"), marker=marker[head],
                         ls="--" if provider in DASHED else "-", label=f"{provider} · {head}")
            ax_t.plot(ns, [_float(r["ms_p50"]) for _, r in pts], **style)
            mem = [(n, _float(r.get("peak_above_mib"))) for n, r in pts]
            mem = [(n, m) for n, m in mem if m is not None]
            if mem:
                ax_m.plot([n for n, _ in mem], [max(m, 1e-3) for _, m in mem], **style)
        if kernel == "fused_linear":
            for head in heads:
                vocab = next(int(r["vocab"]) for (k, _, h, _), r in data.items() if h == head)
                ns = sorted({n for (k, _, h, n) in data if h == head})
                ax_m.plot(ns, [n * vocab * 2 / 2**20 for n in ns], color="grey", ls="--",
                          marker=marker[head], alpha=0.5, label=f"one bf16 [N,V] · {head}")
        ax_t.set(xscale="log", yscale="log", xlabel="N tokens", ylabel="ms (median)",
                 title=f"{kernel}: time, {mode}")
        ax_m.set(xscale="log", yscale="log", xlabel="N tokens",
                 ylabel="peak above inputs+grads (MiB)", title=f"{kernel}: memory, {mode}")
        ticks = sorted({n for (k, _, _, n) in data if k == kernel})
        for ax in row_axes:
            ax.set_xticks(ticks, [str(n) for n in ticks])  # the measured N, not decades
            ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    devices = sorted({r["device"] for r in data.values()})
    fig.suptitle(title or f"grpo-kernels benchmarks on {', '.join(devices)}", fontsize=11)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _save_small_png(fig, out)
    plt.close(fig)
    return out


def _save_small_png(fig, out: Path) -> None:
    """PNG at 80 dpi, reduced to a 64-colour palette: a plot of lines and text stays readable
    at a fraction of the size, so results can be committed."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, dpi=80, format="png")
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=64).save(out, optimize=True)


def main(argv: Sequence[str] | None = None) -> int:
    from .runner import read_csv

    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+", help="result CSV(s) written by python -m benchmarks")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--mode", default="fwd+bwd", choices=("forward", "backward", "fwd+bwd"))
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    rows = [r for path in args.csv for r in read_csv(path)]
    written = plot(rows, args.out, args.mode, args.title)
    print(f"wrote {written}" if written else f"no ok rows for mode {args.mode}")
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
