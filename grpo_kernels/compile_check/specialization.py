"""Triton's JITFunction argument specialization, mirrored without a GPU: the signature,
constexprs and attributes `ASTSource` needs to compile one launch as the runtime would
(Triton 3.4 - 3.9), for `compile_check`. `Ptr` stands for a tensor argument.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ptr:
    """A tensor argument: element type ("bf16", "fp32", "i64", ...) and its byte offset from a
    fresh allocation (PyTorch's CUDA allocator returns 512-byte aligned blocks)."""
    elem: str
    offset: int = 0


def specialize(value, specialize_value: bool = True, align: bool = True) -> tuple:
    """(type, key) as Triton's JITFunction specializes one non-constexpr argument (Triton 3.4's
    `specialize_impl` in runtime/jit.py; 3.5-3.9 do the same in C++, `native_specialize_impl`):
    an int equal to 1 becomes the constant 1, an int or a pointer divisible by 16 gets key "D"
    (tt.divisibility = 16), floats and bools are never specialized; `do_not_specialize` turns
    both off, `do_not_specialize_on_alignment` only the "D"."""
    if isinstance(value, bool):
        return ("u1", None)
    if isinstance(value, int):
        if value == 1 and specialize_value:
            return ("constexpr", 1)
        ty = "i32" if -2**31 <= value < 2**31 else "u64" if value >= 2**63 else "i64"
        if not specialize_value:
            return (ty, None)
        return (ty, "D" if align and value % 16 == 0 else "")
    if isinstance(value, float):
        return ("fp32", None)
    if isinstance(value, Ptr):
        if not specialize_value:
            return ("*" + value.elem, None)
        return ("*" + value.elem, "D" if align and value.offset % 16 == 0 else "")
    if isinstance(value, tuple):  # each element on its own, always specialized (Triton's rule)
        parts = [specialize(x) for x in value]
        if any(ty == "constexpr" for ty, _ in parts):
            raise TypeError(f"a tuple argument with a constant element: {value!r}")
        return tuple(ty for ty, _ in parts), tuple(key for _, key in parts)
    raise TypeError(f"cannot specialize {value!r}")


def signature_of(kernel, args: dict) -> tuple:
    """(signature, constexprs, attrs) for `ASTSource`, as `JITFunction._pack_args` makes them."""
    names = list(kernel.arg_names)
    missing = [n for n in names if n not in args]
    extra = [n for n in args if n not in names]
    if missing or extra:
        raise TypeError(f"kernel_variants does not match {kernel.__name__}'s parameters: "
                        f"missing {missing}, unknown {extra} (update kernel_variants.py)")
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = args[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = value
            continue
        ty, key = specialize(value, not p.do_not_specialize,
                             not p.do_not_specialize_on_alignment)
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = key
        elif key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(key, tuple):  # a tuple's elements are addressed by (i, j)
            attrs.update({(i, j): [["tt.divisibility", 16]] for j, k in enumerate(key)
                          if k == "D"})
    return signature, constexprs, attrs
