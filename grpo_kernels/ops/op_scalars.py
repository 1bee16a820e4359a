"""The float hyperparameters of the custom operators (the temperature, the logit transform's
softcap and logit_scale, and the float fields of `params.TokenLossArgs`) travel as 0-d float64
CPU tensors: the schema types them `Tensor` (`Tensor?` where None is allowed).

Why: under torch.compile a Python float that changes between calls becomes a symbolic float
(Dynamo's automatic dynamic floats), but a `float` argument of a custom operator specializes it
again, so a compiled step recompiled for every new beta, temperature or clip range (a schedule)
and gave up at Dynamo's recompile limit. A tensor argument stays a graph input: one graph
serves every value. The values that select code paths stay Python values outside the ops and
are guarded where they are compared (beta == 0 drops the KL terms, softcap / delta /
logit_scale None or not); strings and flags (loss_type, use_bias_correction_kl) stay in the
schema as they are.

The float64 tensor holds the Python float exactly, and an op's body reads it back with
`of_op` (a CPU tensor: no device synchronisation), so eager values are the floats given. The
eager chunked calls that skip the operator (`custom_ops._EagerFirst`) keep plain floats, which
`of_op` takes as they are.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from ..params import TokenLossArgs
from ..traced_floats import scalar_tensor

F64 = torch.float64
# the argument names, in every op's schema, of the values carried as 0-d tensors
NAMES = frozenset({"temperature", "softcap", "logit_scale"} | {
    f.name for f in fields(TokenLossArgs) if f.type.startswith("float")})


def to_op(value):
    """A Python number (or a traced symbolic one) -> a 0-d float64 CPU tensor; None and tensors
    as they are."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    return scalar_tensor(value, F64)  # a symbolic float stays symbolic (traced_floats.py)


def of_op(value):
    """A value an op's body got -> the Python float (None, floats, str and bool as they are)."""
    return value.item() if isinstance(value, torch.Tensor) else value


class WithScalars:
    """An operator packet called with Python numbers where its schema takes the hyperparameter
    tensors (NAMES): `__call__` converts them (`to_op`) and calls the operator; `args` gives the
    converted positional arguments (for `torch.library.opcheck`). Every other attribute
    (`.default`, the schema) is the operator's."""

    def __init__(self, packet):
        self.packet = packet
        schema = packet.default._schema
        self.at = frozenset(i for i, a in enumerate(schema.arguments) if a.name in NAMES)

    def args(self, *args) -> tuple:
        return tuple(to_op(a) if i in self.at else a for i, a in enumerate(args))

    def __call__(self, *args, **kwargs):
        kwargs = {k: to_op(v) if k in NAMES else v for k, v in kwargs.items()}
        return self.packet(*self.args(*args), **kwargs)

    def __getattr__(self, name):
        return getattr(self.packet, name)
