"""Sizes and number formats: the byte units every figure is printed in, the precision names a
RunConfig uses and the torch dtypes they stand for, and a tensor's size in bytes.

Byte units are binary (KiB = 2^10, MiB = 2^20, GiB = 2^30), as torch's and the kernel's memory
counters are, except GB and MB: decimal (10^9, 10^6), the unit the ZeRO paper (Rajbhandari et
al. 2020) and Korthikanti et al. 2022 report in (7.5B parameters x 16 bytes = 120 GB).
"""

from __future__ import annotations

import torch

KiB = 2**10
MiB = 2**20
# a disk with less free than this counts as full: a save that failed then failed for space,
# and the step ledger stays off a FileStore there
FULL_DISK_BYTES = MiB
GiB = 2**30
MB = 1e6  # decimal megabyte
GB = 1e9  # decimal gigabyte: the papers' unit

# RunConfig's precision names (precision, param_dtype, reduce_dtype) and the dtypes they mean.
PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(precision: str) -> torch.dtype:
    """The torch dtype a precision name stands for ("bf16" -> torch.bfloat16)."""
    if precision not in DTYPES:
        raise ValueError(f"precision {precision!r} is not one of: {', '.join(DTYPES)}")
    return DTYPES[precision]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once; a
    DTensor by its local shard; None skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes a tensor's elements take (a DTensor: its local shard's; None: 0)."""
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # a DTensor holds only its local shard on this rank
        t = t.to_local()
    return t.numel() * t.element_size()
