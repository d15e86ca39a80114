"""Helpers for running Triton kernels under the CPU interpreter (``TRITON_INTERPRET=1``) in tests."""
from __future__ import annotations


class OutOfBounds(AssertionError):
    """A kernel under the interpreter touched memory outside every tensor passed to its launch."""


def check_bounds() -> None:
    """Make the interpreter fail any load, store or atomic whose live lanes (mask on) reach outside the tensors of the
    kernel's launch (idempotent): a CPU stand-in for compute-sanitizer's memcheck.

    Each tensor argument (also inside a tuple, a ``triton.reinterpret`` wrapper or a host ``TensorDescriptor``)
    allows the bytes from its first to its last element, [data_ptr, data_ptr + itemsize * (1 + sum((size - 1) *
    stride))): a read past the last row of a row slice into the rest of its storage (``w[:N]`` of a longer weight)
    counts as out of bounds, as on a GPU it would read another tensor; the gaps inside a strided view (a padded
    row's tail) do not.  Masked-off lanes are not checked (the GPU does not touch them either).  A violation raises
    :class:`OutOfBounds` (the interpreter reports it as ``InterpreterError``) naming the kernel, the operation, the
    number of bad lanes and the first one's offset from the nearest tensor argument.  A launch made while another is
    being interpreted (a pre-run hook) checks against its own tensors, then the outer launch's again.  All live
    lanes of one access must lie in one tensor: an access that runs from one into another (adjacent in memory) is
    out of bounds too; one that lands wholly in the wrong tensor is not caught.  Needs
    ``TRITON_INTERPRET=1`` (triton 3.6-3.8 ``GridExecutor`` / ``InterpreterBuilder``).
    """
    import inspect

    import numpy as np
    import torch
    from triton.runtime import interpreter as interp

    executor, builder = interp.GridExecutor, interp.InterpreterBuilder
    if getattr(executor.__call__, "_glm5serve_bounds", False):
        return
    init_args, call = executor._init_args_hst, executor.__call__
    launches: list[dict] = []  # the launches being interpreted, innermost last

    def tensors(arg):
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, (tuple, list)):
            for a in arg:
                yield from tensors(a)
        elif hasattr(arg, "base"):  # triton.reinterpret's TensorWrapper, a host TensorDescriptor
            yield from tensors(arg.base)

    def record(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        ranges = []
        for t in tensors([*args_hst, *kwargs_hst.values()]):
            if t.numel():
                span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
                ranges.append((t.data_ptr(), t.data_ptr() + span * t.element_size()))
        if launches:
            launches[-1]["ranges"] = ranges
        return args_hst, kwargs_hst

    def interpret(self, *args, **kwargs):
        launches.append({"kernel": getattr(self.fn, "__name__", "?"), "ranges": []})
        try:
            return call(self, *args, **kwargs)
        finally:
            launches.pop()

    def check(op, ptrs, mask):
        if not launches:
            return
        launch = launches[-1]
        p = np.asarray(ptrs.data).astype(np.int64)
        live = (np.broadcast_to(np.asarray(mask.data, dtype=bool), p.shape) if mask is not None
                else np.ones(p.shape, dtype=bool))
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(p.shape, dtype=bool)
        whole = False  # one tensor holds every live lane
        for lo, hi in launch["ranges"]:
            in_r = (p >= lo) & (p + size <= hi)
            inside |= in_r
            whole = whole or bool(np.all(in_r | ~live))
        bad = live & ~inside
        if not bad.any() and not whole:  # e.g. a row read running from one tensor into the next one in memory
            raise OutOfBounds(f"{launch['kernel']}: {op}: its lanes lie in more than one tensor argument")
        if bad.any():
            first = int(p[bad].flat[0])
            lo, hi = min(launch["ranges"], key=lambda r: min(abs(first - r[0]), abs(first - r[1])),
                         default=(0, 0))
            where = (f"{first - lo:+d} bytes from the nearest tensor argument, of {hi - lo} bytes" if hi
                     else "no tensor arguments")
            raise OutOfBounds(f"{launch['kernel']}: {op} of {int(np.count_nonzero(bad))} lane(s) out of bounds "
                              f"(first at {where})")

    def wrap(name, ptr_at, mask_at):
        original = getattr(builder, name)
        params = list(inspect.signature(original).parameters)[1:]  # without self

        def checked(self, *args, **kwargs):
            bound = dict(zip(params, args), **kwargs)
            check(name, bound[params[ptr_at]], bound[params[mask_at]] if mask_at is not None else None)
            return original(self, *args, **kwargs)
        setattr(builder, name, checked)

    wrap("create_masked_load", 0, 1)
    wrap("create_masked_store", 0, 2)
    wrap("create_atomic_rmw", 1, 3)
    wrap("create_atomic_cas", 0, None)
    executor._init_args_hst = record
    interpret._glm5serve_bounds = True
    executor.__call__ = interpret
