"""ZeRO-2 and ZeRO-3 model-state memory per GPU and per node's CPU, with and without offload,
by the rules of DeepSpeed's own estimators.

Reference: DeepSpeed's `estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/
stage_1_and_2.py) and `estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/
stage3.py), and the tables their `..._all_cold` / `..._all_live` helpers print; the rules
are explained on DeepSpeed's "Memory Requirements" docs page
(deepspeed.readthedocs.io/en/latest/memory.html). Written here in our own terms; the
tests (tests/test_zero_memory.py) reproduce the rows that page and Hugging Face
Transformers' DeepSpeed guide publish, to the 2 decimals DeepSpeed prints.

Units. Every function returns **bytes**. DeepSpeed prints bytes / 2**30 with the label
"GB": that is GiB (distlab.units.GiB), not the ZeRO paper's GB = 1e9. `report()` keeps
DeepSpeed's label so its output can be compared line by line; `rows()` says GiB.

Terms (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models"): Ψ the model's parameters, N_d the data-parallel GPUs (here all of
them, nodes × GPUs per node), mixed-precision Adam. DeepSpeed's byte counts per parameter:

  on a GPU   2     fp16 parameters
             18    = 2 fp16 gradients + 4 fp32 gradients + 4 fp32 parameters + 8 fp32
                   momentum and variance: the partitioned part, 18Ψ/N_d (one byte-count
                   for ZeRO-2's P_os+g and ZeRO-3's P_os+g+p alike: DeepSpeed's rule)
             4·L   ZeRO-3 only: the largest layer's L parameters gathered in fp16 and its
                   fp16 gradients (the working set of one layer)
  on a CPU   16    fp32 parameters, gradients, momentum, variance (offloaded optimizer)
             18    the same + the fp16 parameters (ZeRO-3 with offload_param)
             4     per GPU of the node: each process builds the model in fp32 before it is
                   partitioned (not needed with ZeRO-3's zero.Init, which partitions as
                   it builds: then only the largest layer is built whole)
  all CPU figures × `buffer` (DeepSpeed's additional_buffer_factor, 1.5 by default)

So, with n GPUs per node, N_d = nodes · n and f = buffer (the ZeRO-3 CPU terms are per
node, the whole model's share 1/nodes):

  ZeRO-2    offload_optimizer   GPU 2Ψ                      CPU Ψ · max(4N_d, 16) · f
            none                GPU 2Ψ + 18Ψ/N_d            CPU Ψ · 4n · f
  ZeRO-3    offload param+opt   GPU 4L                      CPU Ψ · 18/nodes · f
            offload optimizer   GPU 4L + 2Ψ/N_d             CPU Ψ · 16/nodes · f
            none                GPU 4L + 18Ψ/N_d            CPU L · 4n · f
            without zero.Init the CPU figure is at least Ψ · 4n · f (the fp32 build)

(ZeRO-2's offloaded CPU figure grows with all GPUs, N_d, not those of one node:
DeepSpeed's code, which the docs page writes as n; we follow the code.)

Versions. ZeRO-2 without offload was 4Ψ + 16Ψ/N_d on the GPU until DeepSpeed v0.14.3
(June 2024, PR #5099, "fixing memory estimation": parameters counted at 2 bytes, fp16 or
bf16, not 4), and the docs page's ZeRO-2 example was printed before that: `legacy=True`
gives the old rule. The ZeRO-3 rules have not changed since the estimators were added
(v0.4.2, 2021).

DeepSpeed truncates each figure to whole bytes, and the 18Ψ/N_d and 2Ψ/N_d shares before
adding; so do we. Model states only: activations, temporary buffers and the CUDA context
come on top.

Beside them, the ZeRO paper's own reading of its formula (distlab.theory.estimate's
zero_model_states): how many times less a rank holds than under plain data parallelism,
`zero_reduction`, and what that tends to as N_d grows, `zero_reduction_limit` (the "4×" and
"8×" of the paper's Figure 1 are these limits for K = 12).

    from distlab.theory.zero_memory import report, rows, table_cells
    print(report(3, 2851e6, 32e6, gpus_per_node=8))   # DeepSpeed's ZeRO-3 table for t5-3b
    rows(3, 2851e6, 32e6, gpus_per_node=8)            # the same figures as dicts
    table(*table_cells(2851e6, 32e6, gpus_per_node=8))  # ZeRO-2 and -3, lab.common.table
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

from distlab.theory.estimate import BytesPerParam, zero_model_states
from distlab.units import GiB

BUFFER = 1.5  # DeepSpeed's additional_buffer_factor: a margin on every CPU figure
FP16 = 2      # bytes of an fp16 parameter (or gradient)
FP32_MODEL = 4  # bytes per parameter of the fp32 model each process first builds
PARTITIONED = 18  # fp16 grads 2 + fp32 grads 4 + fp32 params 4 + momentum, variance 8
OPTIMIZER_CPU = 16  # fp32 params, grads, momentum, variance on the CPU
OPTIMIZER_AND_PARAMS_CPU = 18  # the same + the fp16 parameters


@dataclass(frozen=True)
class Estimate:
    """One row of DeepSpeed's table: a ZeRO stage and offload choice, its bytes."""
    stage: int
    offload_param: bool
    offload_optimizer: bool
    zero_init: bool | None  # ZeRO-3 only
    cpu_bytes: int  # per node
    gpu_bytes: int  # per GPU

    @property
    def options(self) -> str:
        """The options column as DeepSpeed prints it ('cpu ' is padded to 4 characters)."""
        def device(on):
            return "cpu " if on else "none"
        if self.stage == 2:
            return f"offload_optimizer={device(self.offload_optimizer)}"
        return (f"offload_param={device(self.offload_param)}, "
                f"offload_optimizer={device(self.offload_optimizer)}, "
                f"zero_init={int(self.zero_init)}")

    def line(self) -> str:
        """The row as DeepSpeed prints it, its GiB labelled 'GB'."""
        return (f" {self.cpu_bytes / GiB:7.2f}GB | {self.gpu_bytes / GiB:6.2f}GB | "
                f"{self.options}")


# -- checks ------------------------------------------------------------------------------------
def _count(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number of parameters, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


def _check(psi, gpus_per_node, nodes, buffer, largest_layer=0) -> None:
    _count("total_params", psi)
    _count("largest_layer_params", largest_layer)
    if largest_layer > psi:
        raise ValueError(f"largest_layer_params ({largest_layer}) exceeds total_params ({psi})")
    _positive_int("gpus_per_node", gpus_per_node)
    _positive_int("nodes", nodes)
    if isinstance(buffer, bool) or not isinstance(buffer, Real) or not buffer > 0:
        raise ValueError(f"buffer must be a number > 0, got {buffer!r}")


# -- the two estimators ------------------------------------------------------------------------
def zero2_model_states(psi, gpus_per_node: int = 1, nodes: int = 1,
                       offload_optimizer: bool = True, buffer: float = BUFFER,
                       legacy: bool = False) -> Estimate:
    """ZeRO-2 (P_os+g): bytes per node's CPU and per GPU for Ψ = `psi` parameters.
    legacy: DeepSpeed's GPU rule before v0.14.3 without offload, 4Ψ + 16Ψ/N_d."""
    _check(psi, gpus_per_node, nodes, buffer)
    n_d = nodes * gpus_per_node
    if offload_optimizer:
        gpu = FP16 * psi
        cpu = psi * max(FP32_MODEL * n_d, OPTIMIZER_CPU) * buffer
    elif legacy:
        gpu = 2 * FP16 * psi + int(OPTIMIZER_CPU * psi / n_d)
        cpu = psi * FP32_MODEL * gpus_per_node * buffer
    else:
        gpu = FP16 * psi + int(PARTITIONED * psi / n_d)
        cpu = psi * FP32_MODEL * gpus_per_node * buffer
    return Estimate(2, False, offload_optimizer, None, int(cpu), int(gpu))


def zero3_model_states(psi, largest_layer, gpus_per_node: int = 1, nodes: int = 1,
                       offload_param: bool = True, offload_optimizer: bool = True,
                       zero_init: bool = True, buffer: float = BUFFER) -> Estimate:
    """ZeRO-3 (P_os+g+p): bytes per node's CPU and per GPU for Ψ = `psi` parameters whose
    largest layer (module) holds `largest_layer`. Offloading parameters without the
    optimizer is not a DeepSpeed option and is refused."""
    _check(psi, gpus_per_node, nodes, buffer, largest_layer)
    if offload_param and not offload_optimizer:
        raise ValueError("ZeRO-3 offloads parameters only together with the optimizer")
    n_d = nodes * gpus_per_node
    working_set = FP16 * 2 * largest_layer  # one layer's fp16 parameters and gradients
    fp32_build = FP32_MODEL * gpus_per_node  # per parameter, without zero.Init
    if offload_optimizer:
        per_param = OPTIMIZER_AND_PARAMS_CPU if offload_param else OPTIMIZER_CPU
        share = per_param / nodes
        cpu = psi * (share if zero_init else max(fp32_build, share)) * buffer
        gpu = working_set + (0 if offload_param else int(FP16 * psi / n_d))
    else:
        cpu = (largest_layer if zero_init else psi) * fp32_build * buffer
        gpu = working_set + int(PARTITIONED * psi / n_d)
    return Estimate(3, offload_param, offload_optimizer, zero_init, int(cpu), int(gpu))


# -- DeepSpeed's tables ------------------------------------------------------------------------
def estimates(stage: int, psi, largest_layer=0, gpus_per_node: int = 1, nodes: int = 1,
              buffer: float = BUFFER, legacy: bool = False) -> list[Estimate]:
    """Every offload choice DeepSpeed's `..._all_cold` helper lists, in its order:
    ZeRO-2: offload_optimizer cpu, none; ZeRO-3: (param, optimizer) = (cpu, cpu),
    (none, cpu), (none, none), each with zero_init 1 then 0. `legacy`: ZeRO-2 only."""
    if stage == 2:
        return [zero2_model_states(psi, gpus_per_node, nodes, off, buffer, legacy)
                for off in (True, False)]
    if stage == 3:
        return [zero3_model_states(psi, largest_layer, gpus_per_node, nodes, param, opt, init,
                                   buffer)
                for param, opt in ((True, True), (False, True), (False, False))
                for init in (True, False)]
    raise ValueError(f"stage must be 2 or 3 (DeepSpeed's estimators), got {stage!r}")


def rows(stage: int, psi, largest_layer=0, gpus_per_node: int = 1, nodes: int = 1,
         buffer: float = BUFFER, legacy: bool = False) -> list[dict]:
    """estimates() as dicts for a notebook table: options, CPU GiB per node, GPU GiB per
    GPU (DeepSpeed's 2 decimals, as strings), and the bytes themselves."""
    return [{"options": e.options,
             "CPU per node (GiB)": f"{e.cpu_bytes / GiB:.2f}",
             "GPU per GPU (GiB)": f"{e.gpu_bytes / GiB:.2f}",
             "cpu_bytes": e.cpu_bytes, "gpu_bytes": e.gpu_bytes,
             "stage": e.stage, "offload_param": e.offload_param,
             "offload_optimizer": e.offload_optimizer, "zero_init": e.zero_init}
            for e in estimates(stage, psi, largest_layer, gpus_per_node, nodes, buffer,
                               legacy)]


UNITS = {"GiB": GiB, "MiB": 2**20}


def table_cells(psi, largest_layer=0, gpus_per_node: int = 1, nodes: int = 1,
                stages=(2, 3), unit: str = "GiB", buffer: float = BUFFER,
                legacy: bool = False) -> tuple[list[str], list[list]]:
    """(header, rows) for distlab.lab.common.table: each stage's offload choices, the CPU
    figure per node and the GPU figure per GPU in `unit` (GiB, DeepSpeed's "GB", or MiB for
    small models), 2 decimals."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {sorted(UNITS)}, got {unit!r}")
    header = ["ZeRO", "options", f"CPU per node ({unit})", f"GPU per GPU ({unit})"]
    cells = [[f"ZeRO-{e.stage}", e.options.replace(" ,", ",").rstrip(),
              f"{e.cpu_bytes / UNITS[unit]:,.2f}", f"{e.gpu_bytes / UNITS[unit]:,.2f}"]
             for stage in stages
             for e in estimates(stage, psi, largest_layer, gpus_per_node, nodes, buffer,
                                legacy)]
    return header, cells


def report(stage: int, psi, largest_layer=0, gpus_per_node: int = 1, nodes: int = 1,
           buffer: float = BUFFER, legacy: bool = False) -> str:
    """The text DeepSpeed's `estimate_zero{2,3}_model_states_mem_needs_all_cold` prints
    (its "GB" is GiB). Its parameter counts are shown truncated to whole millions."""
    found = estimates(stage, psi, largest_layer, gpus_per_node, nodes, buffer, legacy)
    model = f"{int(psi / 1e6)}M total params"
    if stage == 3:
        model += f", {int(largest_layer / 1e6)}M largest layer params"
    hw = (f"{nodes} node{'s' if nodes > 1 else ''}, "
          f"{gpus_per_node} GPU{'s' if gpus_per_node > 1 else ''} per node")
    head = ["Estimated memory needed for params, optim states and gradients for a:",
            f"HW: Setup with {hw}.",
            f"SW: Model with {model}.",
            "  per CPU  |  per GPU |   Options"]
    return "\n".join(head + [e.line() for e in found])


def model_counts(model) -> tuple[int, int]:
    """(Ψ, largest layer) of a torch module, as DeepSpeed's `..._all_live` helpers count
    them: a parameter shared between modules counted once (by storage), the largest layer
    the module with the most parameters of its own (not its children's)."""
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    largest = max((sum(p.numel() for p in m.parameters(recurse=False))
                   for m in model.modules()), default=0)
    return sum(unique.values()), largest


# -- the ZeRO paper's memory reduction -----------------------------------------------------------
def zero_reduction(stage: int, n_d: int, bpp: BytesPerParam) -> float:
    """How many times less model-state memory a rank holds under ZeRO `stage` than under plain
    data parallelism on n_d ranks (Rajbhandari et al. 2020, Figure 1): (2 + 2 + K)Ψ over the
    stage's bytes, e.g. ZeRO-1 16/(4 + 12/N_d) with K = 12. Ψ cancels."""
    return (zero_model_states(1, n_d, 0, bpp).device
            / zero_model_states(1, n_d, stage, bpp).device)


def zero_reduction_limit(stage: int, bpp: BytesPerParam) -> float:
    """zero_reduction as N_d grows without bound: the sharded bytes vanish and what stays is
    what every rank still replicates, the parameters (and for ZeRO-1 the gradients). ZeRO-3
    replicates nothing: its reduction is N_d itself, unbounded (math.inf)."""
    if stage == 3:
        return math.inf
    return bpp.total / (bpp.params + (bpp.grads if stage == 1 else 0))
