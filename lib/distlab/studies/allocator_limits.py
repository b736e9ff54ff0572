"""Two allocator controls people reach for when a GPU runs out of memory, measured.

    torch.cuda.empty_cache()
        hands the caching allocator's wholly free segments back to the driver: reserved
        memory falls to what live blocks' segments hold. It frees no tensor, and a segment
        that still holds one live block stays (distlab.studies.fragmentation's holes).
    torch.cuda.set_per_process_memory_fraction(f)
        caps what this process's allocator may hold at f × the device's memory: a request
        past the cap raises torch.OutOfMemoryError although the device has room.

`measure_allocator_limits()` runs both on the current CUDA device: it allocates `count`
tensors of `mib` MiB, frees every other one, frees the rest, and reads memory_reserved before
and after empty_cache() at each stage; then it sets a fraction just above what the process
holds, asks for more than that leaves, and restores the fraction. On a machine without CUDA it
returns a report that says so and measures nothing (notebook 12 then shows the rows as "not
measured here"; tests/gpu/test_allocator_limits.py runs it on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from distlab.units import MiB

NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False): nothing was measured"


@dataclass
class AllocatorLimits:
    cuda: bool
    reason: str = ""
    device: str = ""
    reserved: dict = field(default_factory=dict)  # stage -> memory_reserved() in bytes
    allocated: dict = field(default_factory=dict)  # stage -> memory_allocated() in bytes
    fraction: float | None = None  # the cap that was set
    capped_oom: str | None = None  # the OutOfMemoryError a request past the cap raised
    uncapped_ok: bool | None = None  # the same request after the cap was lifted


def measure_allocator_limits(mib: int = 8, count: int = 16) -> AllocatorLimits:
    """See the module docstring. `mib`: each tensor's size; `count`: how many."""
    if not torch.cuda.is_available():
        return AllocatorLimits(cuda=False, reason=NO_CUDA)
    dev = torch.device("cuda", torch.cuda.current_device())
    out = AllocatorLimits(cuda=True, device=torch.cuda.get_device_name(dev))
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()

    def read(stage):
        torch.cuda.synchronize(dev)
        out.reserved[stage] = torch.cuda.memory_reserved(dev)
        out.allocated[stage] = torch.cuda.memory_allocated(dev)

    read("start")
    n = mib * MiB // 4
    live = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(count)]
    read("allocated")
    del live[::2]  # every other one: segments keep a live block each
    read("half freed")
    torch.cuda.empty_cache()
    read("half freed, empty_cache")
    live.clear()
    read("all freed")
    torch.cuda.empty_cache()
    read("all freed, empty_cache")
    out.fraction, out.capped_oom, out.uncapped_ok = _fraction_cap(dev, mib)
    return out


def _fraction_cap(dev, mib: int) -> tuple[float, str | None, bool]:
    """Cap the process just above what it holds, ask for 4 × mib more: the error, if any, and
    whether the same request succeeds once the cap is lifted (fraction 1.0)."""
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = (torch.cuda.memory_reserved(dev) + mib * MiB) / total
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    oom = None
    try:
        x = torch.empty(4 * mib * MiB // 4, dtype=torch.float32, device=dev)
        del x
    except torch.OutOfMemoryError as e:
        oom = str(e).splitlines()[0]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
    try:
        x = torch.empty(4 * mib * MiB // 4, dtype=torch.float32, device=dev)
        del x
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    return fraction, oom, ok


def released(r: AllocatorLimits, stage: str) -> int:
    """Bytes empty_cache() handed back to the driver at `stage` ("half freed", "all freed")."""
    return r.reserved[stage] - r.reserved[f"{stage}, empty_cache"]


def freed(r: AllocatorLimits, stage: str) -> int:
    """Bytes of tensors freed since the allocation, at `stage`."""
    return r.allocated["allocated"] - r.allocated[stage]


def empty_cache_released(r: AllocatorLimits) -> bool:
    """empty_cache() gave back every segment once all tensors were freed (reserved back to
    where it started), but not all the holes of the half-freed stage (segments that still
    held a live block stayed)."""
    return (r.reserved["all freed, empty_cache"] <= r.reserved["start"]
            and released(r, "half freed") < freed(r, "half freed"))


def fraction_capped(r: AllocatorLimits) -> bool:
    """A request past the cap raised OutOfMemoryError, and the same request fit without it."""
    return r.capped_oom is not None and bool(r.uncapped_ok)
