"""How the chunked path cuts its work: the element budgets of a logits block or tile, the tile
shape of a linear head, row blocks of a [B, T] batch, and the tokens whose gradient is not zero.
Shared by the launchers of plain logits (`linear_launchers.py`, `logits_launchers.py`) and of
transformed ones (`softcap.py`).
"""

from __future__ import annotations

# Logits input: elements of one [rows, V] float32 block (one buffer; two with an entropy
# gradient): 16 MiB.
CHUNK_ELEMENTS = 2**22
# Linear head: at least TILE_ROWS tokens per tile (each weight tile is reused by that many tokens,
# enough for the GEMMs to stay compute-bound) and TILE_ELEMENTS per [rows, cols] float32 logits
# tile: 64 MiB, one buffer (two with an entropy gradient). Tiles are large on purpose: every
# elementwise op is one parallel region, and on a busy machine each region waits until all its
# threads get a core (tens of ms at a load of 10+ on 2 cores), so few large ops beat many small
# cache-sized ones there; on an idle machine the difference is small.
TILE_ROWS = 256
TILE_ELEMENTS = 2**24
# A forward asked to `keep` its logits keeps them when they fit one tile (N·V <= TILE_ELEMENTS / 2,
# 32 MiB of float32), and its backward starts from that tile instead of recomputing it with a
# GEMM: one of the four [N, V, D] matrix products of a forward + backward fewer.
KEEP_ELEMENTS = TILE_ELEMENTS // 2


def block_rows(V: int, chunk_elements: int | None) -> int:
    """Rows of one [rows, V] logits block (at least 1): `chunk_elements` (None: CHUNK_ELEMENTS)
    over V."""
    return max(1, (chunk_elements or CHUNK_ELEMENTS) // max(V, 1))


def tile_shape(N: int, V: int, chunk_elements: int | None, buffers: int) -> tuple[int, int]:
    """(rows, cols) of a [rows, cols] linear-head logits tile of N tokens and V columns: `buffers`
    such tiles fit the element budget (`chunk_elements`; None: TILE_ELEMENTS)."""
    budget = max(1, (chunk_elements or TILE_ELEMENTS) // buffers)
    rows = max(1, min(N, max(TILE_ROWS, budget // max(V, 1))))  # whole rows when V is small
    cols = max(1, min(V, budget // rows))
    return rows, cols


def _whole(x):
    return x


def row_parts(n: int, rows: int):
    """Blocks of at most `rows` of n rows, in order: yields (r0, r, part), where part maps a
    tensor [n, ...] to its rows r0 .. r0 + r - 1, a view [r, ...] (r = rows, the last block
    fewer). One block of all n rows (rows >= n) hands tensors on as they are: part is the
    identity, no view op per tensor and block."""
    if rows >= n:
        yield 0, n, _whole
        return
    for r0 in range(0, n, rows):
        r = min(rows, n - r0)
        yield r0, r, lambda x, r0=r0, r=r: x[r0:r0 + r]


def active_rows(g, gh):
    """[Na] indices of the tokens whose gradient coefficient g [N] or gh [N] (None: g alone) is
    not zero; None where all N are."""
    busy = g != 0 if gh is None else (g != 0) | (gh != 0)
    if bool(busy.all()):
        return None
    return busy.nonzero().squeeze(1)


def pick_rows(x, idx, dtype):
    """x [N, ...] -> [Na, ...], the rows `idx` [Na] (`active_rows`; None: all N rows), floating
    point ones in the compute dtype; None stays None."""
    if x is None:
        return None
    x = x if idx is None else x.index_select(0, idx)  # advanced indexing would fork threads
    return x.to(dtype) if x.is_floating_point() else x


def row_blocks(B: int, T: int, C: int):
    """Split [B, T] rows into blocks of about C: whole sequences when C >= T, else pieces of one
    sequence. Yields (block of a [B, T, ...] tensor, block of a flat [B·T, ...] one): each block
    of a [B, T, V] view is itself a view, so sliced logits are never copied whole; one block of
    all B·T rows hands tensors on as they are."""
    if B * T == 0:  # no tokens (e.g. a packed batch of empty sequences): no blocks
        return
    if C >= B * T:
        yield _whole, _whole
    elif C >= T:
        step = C // T
        for b in range(0, B, step):
            n = min(step, B - b) * T
            yield (lambda x, b=b: x[b:b + step]), (lambda v, i=b * T, n=n: v[i:i + n])
    else:
        for b in range(B):
            for t in range(0, T, C):
                n = min(C, T - t)
                yield ((lambda x, b=b, t=t: x[b:b + 1, t:t + C]),
                       (lambda v, i=b * T + t, n=n: v[i:i + n]))


def block_view(buf, shape):
    """The first b·t·V elements of a flat buffer `buf` [>= b·t·V], viewed as `shape` [b, t, V]."""
    n = shape[0] * shape[1] * shape[2]
    return buf.view(shape) if buf.numel() == n else buf[:n].view(shape)


def zero_rows_without_gradient(dx, g, gh) -> None:
    """Writes 0 over the rows of d logits dx [b, t, V] whose tokens have no gradient (g and gh,
    b·t values each, both 0; gh None: g alone): padding gets 0 whatever its logits hold, where
    the tile's arithmetic gave 0·NaN = NaN. A host read (these paths run on the CPU)."""
    dead = (g == 0) if gh is None else (g == 0) & (gh == 0)
    if bool(dead.any()):
        dx[dead.reshape(dx.shape[:2])] = 0
