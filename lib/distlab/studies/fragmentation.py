"""Fragmentation of CUDA's caching allocator: memory reserved, free, and still not usable.

torch does not hand each freed tensor back to the driver: its caching allocator keeps the
*segments* it got from cudaMalloc and carves blocks out of them. Two figures:

    allocated   bytes in blocks that tensors occupy (torch.cuda.memory_allocated)
    reserved    bytes in segments the allocator holds from the driver
                (torch.cuda.memory_reserved); reserved − allocated is cached, free to torch,
                taken from everyone else

A large request (over 1 MiB) is served from a free block at least as large (best fit), which is
split if much larger; blocks merge again only with *adjacent* free blocks of the same segment.
After a run of tensors of varying sizes, free memory lies in holes between live blocks: a new
request larger than every hole needs a new segment, although the holes add up to more than it
asks for. `inactive_split_bytes` (memory_stats) counts those free pieces of segments that
still hold live blocks; they cannot go back to the driver either (torch.cuda.empty_cache()
releases only wholly free segments). When cudaMalloc fails, the allocator frees every wholly
free cached segment and retries (`num_alloc_retries`); if that fails too it raises "CUDA out of
memory. ... reserved but unallocated", with gigabytes "free" in holes: the OOM after hours of
training with variable shapes. Remedies: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (a
segment is a virtual range that grows by mapping pages, so the holes' pages can be unmapped
and mapped again where the request needs them), max_split_size_mb (large blocks are never
split, so they stay whole for large requests), fixed shapes (bucketing, padding to a few
lengths) and empty_cache() between phases (only wholly free segments).

    fragmentation_from_stats(torch.cuda.memory_stats())   # the figures from a stats dict
    measure_fragmentation()    # the workload below on CUDA, or a report saying there is none

The workload (`measure_fragmentation`, in this process, on the current CUDA device):
allocate `count` tensors of `small_mib` MiB, free every other one (holes of small_mib between
live blocks), then ask for `large` tensors of 2 × small_mib + 2 MiB: no hole can hold one, and
the stats are read after each phase. With `cap_mib` the process may hold only that much more
than it held at the start (torch.cuda.set_per_process_memory_fraction, restored afterwards):
the large requests then run into the cap while the holes add up to more than they ask for, and
the allocator retries, then raises torch.OutOfMemoryError (caught and reported).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from distlab.units import MiB

NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False): nothing was measured"


def fragmentation_from_stats(stats: dict) -> dict:
    """The fragmentation figures from a torch.cuda.memory_stats() dict: allocated and reserved
    bytes, fragmentation = 1 − allocated / reserved (0 when nothing is reserved), inactive
    split bytes, and the allocator's retry and OOM counts."""
    allocated = stats.get("allocated_bytes.all.current", 0)
    reserved = stats.get("reserved_bytes.all.current", 0)
    return {"allocated": allocated, "reserved": reserved,
            "fragmentation": 1.0 - allocated / reserved if reserved else 0.0,
            "inactive_split": stats.get("inactive_split_bytes.all.current", 0),
            "num_alloc_retries": stats.get("num_alloc_retries", 0),
            "num_ooms": stats.get("num_ooms", 0)}


@dataclass
class FragmentationReport:
    cuda: bool  # False: nothing measured; `reason` says why
    reason: str = ""
    device: str = ""
    allocator: str = ""  # PYTORCH_CUDA_ALLOC_CONF as the run saw it
    phases: dict = field(default_factory=dict)  # phase -> fragmentation_from_stats(...)
    large_granted: int = 0  # how many of the large requests were served
    oom: str = ""  # the OutOfMemoryError's first line, if one was raised


def measure_fragmentation(small_mib: int = 6, count: int = 30, large: int = 5,
                          cap_mib: int | None = None) -> FragmentationReport:
    """Run the module's workload on the current CUDA device and read memory_stats() after
    each phase: "start", "filled", "every other freed", "large requests" and, once every
    tensor of the workload is dropped, "after empty_cache". Without CUDA: a report with
    cuda=False and the reason, and no figure."""
    if not torch.cuda.is_available():
        return FragmentationReport(cuda=False, reason=NO_CUDA)
    import os
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()  # start from the segments live tensors need
    report = FragmentationReport(cuda=True, device=torch.cuda.get_device_name(dev),
                                 allocator=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))

    def read(phase):
        torch.cuda.synchronize(dev)
        report.phases[phase] = fragmentation_from_stats(torch.cuda.memory_stats(dev))

    read("start")
    total = torch.cuda.get_device_properties(dev).total_memory
    if cap_mib is not None:
        cap = report.phases["start"]["reserved"] + cap_mib * MiB
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)
    try:
        n = small_mib * MiB // 4  # float32 elements
        small = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(count)]
        read("filled")
        del small[::2]  # holes of small_mib MiB between live blocks
        read("every other freed")
        big, m = [], (2 * small_mib + 2) * MiB // 4
        try:
            for _ in range(large):
                big.append(torch.empty(m, dtype=torch.float32, device=dev))
        except torch.OutOfMemoryError as e:
            report.oom = str(e).splitlines()[0]
        report.large_granted = len(big)
        read("large requests")
        del small, big
        torch.cuda.empty_cache()
        read("after empty_cache")
    finally:
        if cap_mib is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
    return report
