"""The guarded Triton import every kernel family shares, and the launchers' argument checks.

Importing this never fails: without Triton, HAS_TRITON is False, no kernel is defined, and a
launcher raises RuntimeError when called. The CPU engine never launches one."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:          # not installed, or installed but unusable on this machine
    triton = tl = None

HAS_TRITON = triton is not None


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed: the triton kernel set is unavailable")


def check(ok: bool, message: str) -> None:
    """A launcher's argument check: ValueError(message) unless ok."""
    if not ok:
        raise ValueError(message)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if dtype is None:
        check(t.dtype in FLOAT_DTYPES, f"{name}: dtype must be float32, float16 or bfloat16, "
                                       f"got {t.dtype}")
    else:
        check(t.dtype == dtype, f"{name}: dtype must be {dtype} (as the other operands), "
                                f"got {t.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    check(len(devices) == 1, "all operands must be on one device, got "
          + ", ".join(f"{k}={t.device}" for k, t in tensors.items()))


def out_or_new(out: torch.Tensor | None, shape, like: torch.Tensor, name: str = "out"):
    """A launcher's `out=`: checked against the result's shape and dtype, or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check(tuple(out.shape) == tuple(shape), f"{name}: shape must be {tuple(shape)}, "
                                            f"got {tuple(out.shape)}")
    check(out.dtype == like.dtype, f"{name}: dtype must be {like.dtype}, got {out.dtype}")
    check(out.device == like.device, f"{name}: must be on {like.device}, got {out.device}")
    check(out.stride(-1) == 1, f"{name}: last dimension must be contiguous")
    return out
