"""Helpers for running Triton kernels under the CPU interpreter (``TRITON_INTERPRET=1``) in tests."""
from __future__ import annotations


def patch_bf16_dot() -> None:
    """Make the interpreter's ``tl.dot`` exact for bf16 operands (idempotent).

    Triton's interpreter (3.6-3.8) multiplies bf16 ``tl.dot`` operands as their raw 16-bit integers; widening them to
    fp32 first (bf16 is the top half of an fp32) gives the product a GPU computes. Call only with the interpreter on.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    if getattr(builder.create_dot, "_glm5serve_bf16", False):
        return
    create_dot = builder.create_dot

    def widen(h):
        if not h.dtype.is_bf16():
            return h
        return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched(self, a, b, d, *rest):
        return create_dot(self, widen(a), widen(b), d, *rest)

    patched._glm5serve_bf16 = True
    builder.create_dot = patched


class OutOfBounds(AssertionError):
    """A kernel under the interpreter touched memory outside every tensor passed to its launch."""


def check_bounds() -> None:
    """Make the interpreter fail any load, store or atomic whose live lanes (mask on) reach outside the tensors of the
    kernel's launch (idempotent): a CPU stand-in for compute-sanitizer's memcheck.

    Each tensor argument allows the bytes of its view, [data_ptr, data_ptr + itemsize * (1 + sum((size - 1) *
    stride))): a read past a view into the rest of its storage (a padded or sliced weight) counts as out of bounds,
    as on a GPU it would read another tensor.  Masked-off lanes are not checked (the GPU does not touch them either).
    A violation raises :class:`OutOfBounds` (the interpreter reports it as ``InterpreterError``) naming the kernel,
    the operation, the number of bad lanes and the first one's offset from the nearest tensor argument.  Needs
    ``TRITON_INTERPRET=1`` (triton 3.6-3.8 ``GridExecutor`` / ``InterpreterBuilder``).
    """
    import numpy as np
    import torch
    from triton.runtime import interpreter as interp

    executor, builder = interp.GridExecutor, interp.InterpreterBuilder
    if getattr(executor._init_args_hst, "_glm5serve_bounds", False):
        return
    init_args = executor._init_args_hst
    launch: dict = {"kernel": "?", "ranges": []}  # the launch being interpreted (one at a time)

    def record(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        ranges = []
        for arg in [*args_hst, *kwargs_hst.values()]:
            if isinstance(arg, torch.Tensor) and arg.numel():
                span = 1 + sum((n - 1) * s for n, s in zip(arg.shape, arg.stride()))
                ranges.append((arg.data_ptr(), arg.data_ptr() + span * arg.element_size()))
        launch.update(kernel=getattr(self.fn, "__name__", "?"), ranges=ranges)
        return args_hst, kwargs_hst

    def check(op, ptrs, mask):
        p = np.asarray(ptrs.data).astype(np.int64)
        live = np.broadcast_to(np.asarray(mask.data, dtype=bool), p.shape) if mask is not None else True
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(p.shape, dtype=bool)
        for lo, hi in launch["ranges"]:
            inside |= (p >= lo) & (p + size <= hi)
        bad = live & ~inside
        if bad.any():
            first = int(p[bad].flat[0])
            lo, hi = min(launch["ranges"], key=lambda r: min(abs(first - r[0]), abs(first - r[1])),
                         default=(0, 0))
            where = f"{first - lo:+d} bytes from a tensor of {hi - lo} bytes" if hi else "no tensor arguments"
            raise OutOfBounds(f"{launch['kernel']}: {op} of {int(np.count_nonzero(bad))} lane(s) out of bounds "
                              f"(first at {where})")

    def wrap(name, ptr_at, mask_at):
        original = getattr(builder, name)

        def checked(self, *args):
            check(name, args[ptr_at], args[mask_at] if mask_at is not None else None)
            return original(self, *args)
        setattr(builder, name, checked)

    wrap("create_masked_load", 0, 1)
    wrap("create_masked_store", 0, 2)
    wrap("create_atomic_rmw", 1, 3)
    wrap("create_atomic_cas", 0, None)
    record._glm5serve_bounds = True
    executor._init_args_hst = record
