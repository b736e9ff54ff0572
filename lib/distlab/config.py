"""RunConfig: every knob of a run, checked before any process starts.

A config is plain data (it is pickled into spawned ranks and written to `config.json` in the
run's folder), so it holds only strings, numbers and booleans.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from dataclasses import dataclass, fields

from distlab.models import factory
from distlab.units import DTYPES
# Each strategy names how the one training loop is parallelised. What a strategy supports, its
# data-parallel degree and its own checks are declared by its class (distlab.parallel.REGISTRY).
from distlab.parallel import STRATEGIES  # noqa: F401  (re-exported: the panel lists them)
from distlab.parallel import FEATURES, KNOBS, strategies, strategy_class
from distlab.parallel.mesh import ORDERS

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved")
MESH_ORDERS = ORDERS  # 3d's rank orders (distlab.parallel.mesh)
MODELS = ("gpt", "bnnet")
COMPRESSIONS = ("none", "topk", "powersgd")  # topk: ddp's; powersgd: ddp-torch's (torch's hook)
LOSS_SCALES = ("auto", "dynamic", "none")  # auto: dynamic for fp16, none otherwise
CHECKPOINTING = ("none", "full", "selective")
ALLREDUCE_ALGORITHMS = ("torch", "ring", "naive")
DP_GATHERS = ("logits", "loss")
OPTIMIZERS = ("sgd", "adamw")
PRECISIONS = tuple(DTYPES)  # "fp32", "bf16", "fp16" (distlab.units)
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
# Training bugs on purpose, for the debugging drills (distlab.debug.bugs says what each does);
# "none" first: the default
BUGS = ("none", "shuffled_labels", "zero_init", "no_zero_grad", "loss_not_divided", "same_rows")
# LoRA's target presets: regexes on module names (distlab.finetune.lora); any other value is a regex
LORA_TARGETS = {
    "qv": r"attn\.(q|v)$",
    "attn": r"attn\.(q|k|v|o)$",
    "attn_mlp": r"(attn\.(q|k|v|o)|mlp\.(fc|proj))$",
}
# Injected faults, for the drills that prove the launcher's process safety.
FAULTS = ("none", "raise", "stall", "kill", "nan",  # nan: a NaN in one weight (distlab.debug.nan)
          "kill_in_save")  # SIGKILL halfway through writing a checkpoint (distlab.checkpoint)


@dataclass
class RunConfig:
    """One run: what to train, how to parallelise it, and how to launch it.

    `global_batch` is the batch of one optimizer step across all ranks; data-parallel strategies
    give each rank `global_batch // world_size` rows of it, so runs at any world size see the
    same data and can be compared with `single` step by step.
    """

    strategy: str = "single"
    world_size: int = 1
    steps: int = 100
    lr: float = 3e-3
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    global_batch: int = 16
    grad_accum: int = 1  # micro-batches per optimizer step on each rank
    warmup_steps: int = 0  # learning rate rises linearly from lr/warmup_steps to lr
    seq_len: int = 64
    precision: str = "fp32"
    loss_scale: str = "auto"  # dynamic loss scaling (distlab.rank.precision)
    loss_scale_init: float = 65536.0  # dynamic: the first scale (torch GradScaler's: 2**16)
    loss_scale_growth_interval: int = 2000  # dynamic: clean steps before the scale doubles
    fp32_modules: str = ""  # comma-separated module names kept in fp32 under autocast
    checkpointing: str = "none"  # activation checkpointing per block (distlab.rank.recompute)
    track_peak: bool = False  # memory["peak"] per step: aten-allocated bytes (~20% step time)
    offload: bool = False  # zero*: optimizer state lives on the CPU
    # zero3's mixed-precision policy (distlab.MixedPrecisionPolicy, as FSDP2's): parameters cast
    # to param_dtype before the all-gather and computed in it; gradients reduce-scattered in
    # reduce_dtype ("": param_dtype); fp32 master shards
    param_dtype: str = "fp32"
    reduce_dtype: str = ""
    # zero3's units, comma-separated module names (a ModuleList's name: each of its items);
    # "": the model's own `fsdp_units` attribute if it has one, else the repeated blocks
    fsdp_units: str = ""
    # zero3: how many units ahead of the running one have their all-gather started (FSDP2
    # prefetches 1; 0: each unit is gathered only when its forward or backward needs it)
    fsdp_prefetch: int = 1
    # zero3: "flat" (the ZeRO paper's padded flat units, FSDP1's FlatParameter) or "per_param"
    # (FSDP2's: each parameter a DTensor sharded on dim 0; distlab.parallel.zero.per_param)
    fsdp_layout: str = "flat"
    # fsdp-torch: ranks each shard group spans (0: all of them, FSDP; fewer: HSDP, shard inside
    # groups of that many consecutive ranks, a node's, and replicate across the groups)
    shard_ranks: int = 0
    grad_clip: float = 0.0  # clip gradients to this global norm (0: off)
    # model parallelism (distlab.parallel.tensor.tp / pipeline / mesh)
    tp: int = 1  # tensor-parallel degree
    sp: bool = False  # sequence parallelism in the tensor-parallel regions' LayerNorm/dropout
    pp: int = 1  # pipeline stages (ranks)
    microbatches: int = 1  # pipeline micro-batches per step
    schedule: str = "gpipe"  # naive | gpipe | 1f1b | interleaved
    virtual_stages: int = 1  # interleaved: model chunks per pipeline rank
    mesh_order: str = MESH_ORDERS[0]  # 3d: rank order, fastest kind first (MESH_ORDERS)
    # the mesh (strategy "mesh", distlab.parallel.parallelize): world = pp x dp_replicate x
    # dp_shard x cp x tp. cp: ranks that split every sequence; dp_shard: ranks that shard the
    # model state with ZeRO stage zero_stage (0: the ranks the other degrees leave);
    # dp_replicate: replicas of those shards (HSDP). Setting any of them, or tp/pp without a
    # strategy, picks "mesh"; world_size left at 1 becomes the degrees' product
    cp: int = 1
    dp_shard: int = 0
    dp_replicate: int = 1
    zero_stage: int = 3  # fully_shard's, as torchtitan's dp_shard; 0 all-reduces whole gradients
    ep: int = 1  # mesh: ranks (of the data-parallel ones) over which each MoE's experts spread
    # context parallelism (distlab.parallel.context): ranks per replica that split each
    # sequence (0: all), which tokens each holds, and how attention crosses the split
    cp_ranks: int = 0
    cp_layout: str = "zigzag"  # zigzag (balanced causal work) | contiguous
    cp_attention: str = "ring"  # ring (K/V around the ring) | ulysses (all-to-all to heads)
    # a mixture of experts in each block instead of the MLP (distlab.models.moe; 0: dense);
    # moe_groups: GShard's groups over the global batch (capacity and the balance loss per
    # group; 0: one per data-parallel rank's rows, what expert parallelism routes)
    n_experts: int = 0
    top_k: int = 1  # 1: Switch Transformer's routing; 2: GShard's
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01  # Switch's load-balancing loss, added to the loss
    moe_groups: int = 0
    allreduce: str = "torch"  # algorithm the `allreduce` strategy uses for gradients
    dp_threads: bool = True  # dp: replicas in threads (False: one after another, to time the GIL)
    dp_gather: str = "logits"  # dp: replicas return logits (loss on replica 0), or their "loss"
    pp_op_delay_s: float = 0.0  # pp/3d: a sleep per forward and backward op (bubble demos)
    bucket_mb: float = 0.25  # ddp: gradient bucket size cap, MiB (torch's default is 25)
    # gradient compression: ddp "topk" (top-k with error feedback), ddp-torch "powersgd"
    compress: str = "none"
    topk_ratio: float = 0.01  # fraction of each bucket's entries that topk sends
    powersgd_rank: int = 2  # the rank r of PowerSGD's factors
    # diloco: inner steps between averages, and the outer optimizer (SGD, Nesterov momentum);
    # outer_lr=1, outer_momentum=0 is local SGD (distlab.parallel.data_parallel.diloco)
    sync_every: int = 8
    outer_lr: float = 0.7  # DiLoCo's (Douillard et al. 2023)
    outer_momentum: float = 0.9
    backup_workers: int = 0  # ps-sync: extra workers; each step uses the first gradients to arrive
    # model: the tiny GPT (distlab.models.gpt), a small BatchNorm net (distlab.models.bnnet),
    # or yours: "package.module:function" or "file.py:function" (distlab.models.factory)
    model: str = "gpt"
    data: str = ""  # with your model: your data, "package.module:function" (distlab.models.factory)
    sync_bn: bool = False  # BatchNorm statistics over the global batch (SyncBatchNorm)
    broadcast_buffers: bool = True  # ddp: rank 0's buffers to every rank at each step's start
    hidden_layers: int = 2  # bnnet: hidden Linear+BatchNorm layers (width n_embd)
    bn_classes: int = 4  # bnnet's data (distlab.data.dataset.ClusterData): Gaussian clusters, one
    bn_features: int = 16  # per class, of bn_features dimensions, spread bn_cluster_std around
    bn_cluster_std: float = 1.0  # class centres drawn with std bn_separation
    bn_separation: float = 0.7
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    mlp_ratio: int = 4
    vocab_size: int = 64
    # data: a Markov chain made on the machine (distlab.data.dataset)
    successors: int = 3  # next-token choices per token; sets how low the loss can go
    dataset_size: int = 0  # 0: fresh rows every step; >0: a finite set read by a distributed sampler
    drop_last: bool = True  # sampler: drop the tail that does not divide among ranks
    epochs: int = 1  # finite dataset: passes over it (each reshuffled by the sampler)
    join: bool = False  # uneven inputs: ranks out of data shadow the others' collectives
    seed: int = 0
    task: int = 0  # which Markov chain: 0 the default; k >= 1 redraws half its rows (data.py)
    # fine-tuning (distlab.finetune.lora, distlab.finetune.forgetting)
    init_from: str = ""  # a model state-dict .pt to start from (loaded before LoRA, wrapping)
    save_final: str = ""  # write the trained model's state dict here (adapters merged)
    lora_rank: int = 0  # 0: full fine-tuning; r >= 1: LoRA adapters of rank r, the rest frozen
    lora_alpha: float = 8.0  # adapters' output scaled by lora_alpha / lora_rank
    lora_targets: str = "qv"  # qv | attn | attn_mlp, or a regex on module names
    replay: float = 0.0  # fraction of each batch's rows drawn from task 0 (replay buffer)
    ewc_lambda: float = 0.0  # Elastic Weight Consolidation strength (anchor: the start weights)
    eval_every: int = 0  # "eval" event: held-out loss on tasks 0 and `task` every k steps
    # launch
    backend: str = "auto"
    device: str = "auto"
    timeout_s: float = 60.0  # every collective wait gives up after this long
    threads_per_rank: int = 0  # 0: cores // world_size, at least 1
    step_delay_s: float = 0.0  # sleep per step, to slow a demo down enough to watch
    straggler_rank: int = -1  # this rank sleeps straggler_delay_s each step (-1: none)
    straggler_delay_s: float = 0.0
    runs_root: str = ""  # "" means $DISTLAB_RUNS or ./runs
    # simulated nodes (distlab.caller.cluster_run): world_size ranks split evenly over `nodes`
    # network namespaces joined by links of link_mbit Mbit/s, one torchrun agent per node
    nodes: int = 1
    link_mbit: float = 100.0
    # a rate of its own between two nodes, both ways: "i-j:Mbit/s", comma-separated ("0-1:25")
    link_pairs: str = ""
    name: str = ""
    debug: bool = False  # TORCH_DISTRIBUTED_DEBUG=DETAIL: catches mismatched collectives
    detect_nan: bool = False  # name the step and first module that made inf/NaN (distlab.debug.nan)
    # fault injection: one rank misbehaves at one step
    fault: str = "none"
    fault_rank: int = 0
    fault_step: int = 0
    fault_module: str = ""  # fault="nan": the module whose weight gets the NaN ("": first Linear)
    # debugging drills: a training bug on purpose (BUGS above), and the measurements
    # that find one (distlab.debug.probe: per-layer gradient norms, update/weight ratios, unit
    # spread, batch fingerprints in every step event; the checks: distlab.debug.diagnose)
    bug: str = "none"
    diagnostics: bool = False
    # training checkpoints (distlab.checkpoint)
    checkpoint_every: int = 0  # save every k steps and after the last one (0: off)
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted
    checkpoint_dir: str = ""  # "": <run dir>/checkpoints
    resume_from: str = ""  # a checkpoint, a folder of them, or "auto" (the newest that verifies)

    def __post_init__(self):
        self._check_types()
        self._pick_mesh()
        strategy_class(self.strategy)  # ValueError naming the registry's strategies
        _choice("allreduce", self.allreduce, ALLREDUCE_ALGORITHMS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("precision", self.precision, PRECISIONS)
        _choice("backend", self.backend, BACKENDS)
        _choice("device", self.device, DEVICES)
        _choice("fault", self.fault, FAULTS)
        _choice("bug", self.bug, BUGS)
        self._check_model()
        _choice("compress", self.compress, COMPRESSIONS)
        _choice("loss_scale", self.loss_scale, LOSS_SCALES)
        _choice("checkpointing", self.checkpointing, CHECKPOINTING)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("mesh_order", self.mesh_order, MESH_ORDERS)
        _choice("dp_gather", self.dp_gather, DP_GATHERS)
        _choice("cp_layout", self.cp_layout, ("zigzag", "contiguous"))
        _choice("cp_attention", self.cp_attention, ("ring", "ulysses"))
        _choice("param_dtype", self.param_dtype, PRECISIONS)
        _choice("reduce_dtype", self.reduce_dtype, ("",) + PRECISIONS)
        self._check_knobs()
        self._check_experts()
        if self.param_dtype != "fp32" and self.precision != "fp32":
            raise ValueError(f"param_dtype={self.param_dtype!r} is zero3's mixed precision "
                             f"(parameters cast before the all-gather); precision="
                             f"{self.precision!r} is autocast: pick one (precision='fp32')")
        for name in ("epochs", "hidden_layers", "bn_classes", "bn_features"):
            _positive_int(name, getattr(self, name))
        for name in ("pp_op_delay_s", "bn_cluster_std", "bn_separation"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) >= 0):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a number >= 0")
        if self.fault_module and self.fault != "nan":
            raise ValueError(f"fault_module={self.fault_module!r} picks where fault='nan' puts "
                             f"its NaN; set fault='nan' (got fault={self.fault!r})")
        for name in ("tp", "pp", "microbatches", "virtual_stages"):
            _positive_int(name, getattr(self, name))
        if not (isinstance(self.fsdp_prefetch, int) and self.fsdp_prefetch >= 0):
            raise ValueError(f"fsdp_prefetch={self.fsdp_prefetch!r} must be an integer >= 0 "
                             "(units gathered ahead of need; 0: none)")
        if self.fsdp_layout not in ("flat", "per_param"):
            raise ValueError(f"fsdp_layout={self.fsdp_layout!r} is not one of 'flat' (padded "
                             "flat units) or 'per_param' (each parameter sharded on dim 0)")
        self._check_model_parallel()
        self._check_finetuning()
        self._check_checkpoints()
        if self.checkpointing != "none" and self.model != "gpt":
            raise ValueError(f"checkpointing={self.checkpointing!r} wraps GPT blocks; "
                             f"model={self.model!r} has none")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip={self.grad_clip} must be >= 0 (0: off)")
        _positive_int("loss_scale_growth_interval", self.loss_scale_growth_interval)
        if not self.loss_scale_init > 0:
            raise ValueError(f"loss_scale_init={self.loss_scale_init} must be > 0")
        for name in ("world_size", "steps", "global_batch", "grad_accum", "seq_len", "n_layer",
                     "n_embd", "n_head", "mlp_ratio", "successors"):
            _positive_int(name, getattr(self, name))
        _positive_int("vocab_size", self.vocab_size, minimum=2)
        strategy_class(self.strategy).check_config(self)
        dp = self.dp_degree
        if self.global_batch % dp:
            raise ValueError(f"global_batch={self.global_batch} does not divide among "
                             f"{dp} data-parallel ranks (world_size={self.world_size}); choose "
                             f"a multiple of {dp}")
        if self.local_batch % self.microbatches:
            raise ValueError(f"global_batch={self.global_batch} gives each pipeline "
                             f"{self.local_batch} rows ({dp} data-parallel ranks), not divisible "
                             f"into microbatches={self.microbatches} equal micro-batches; choose "
                             f"a global_batch that is a multiple of {dp * self.microbatches}")
        if self.global_batch % (dp * self.grad_accum):
            raise ValueError(f"global_batch={self.global_batch} does not split into "
                             f"{dp} ranks x grad_accum={self.grad_accum} equal micro-batches; "
                             f"choose a multiple of {dp * self.grad_accum}")
        if not 0 < self.topk_ratio <= 1 or self.bucket_mb <= 0:
            raise ValueError(f"topk_ratio={self.topk_ratio} must be in (0, 1] and "
                             f"bucket_mb={self.bucket_mb} > 0")
        if self.dataset_size < 0:
            raise ValueError(f"dataset_size={self.dataset_size} must be >= 0 (0 = endless)")
        if self.join and self.sync_bn:
            raise ValueError("join=True with sync_bn=True: a rank out of data cannot shadow "
                             "SyncBatchNorm's all-reduces in the forward (nor can torch's Join); "
                             "use drop_last=True or equal batches instead")
        self._check_features()
        self._check_debugging()
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps!r} must be an integer >= 0")
        if not -1 <= self.straggler_rank < self.world_size or self.straggler_delay_s < 0:
            raise ValueError(f"straggler_rank={self.straggler_rank} must be -1 (none) or a rank "
                             f"in [0, {self.world_size}), and straggler_delay_s >= 0")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if self.successors > self.vocab_size:
            raise ValueError(f"successors={self.successors} exceeds vocab_size={self.vocab_size}")
        for name in ("lr", "timeout_s"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a number > 0")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0 (the data and NumPy's generators "
                             "take non-negative seeds)")
        if any(c in self.name for c in "/\\\0") or self.name in (".", ".."):
            raise ValueError(f"name={self.name!r} becomes part of the run's folder name under "
                             "the runs root: no '/', '\\' or NUL, and not '.' or '..' (a path "
                             "would put the run outside the root, where retention never looks)")
        if self.weight_decay < 0 or self.step_delay_s < 0:
            raise ValueError("weight_decay and step_delay_s must be >= 0")
        if self.threads_per_rank < 0:
            raise ValueError(f"threads_per_rank={self.threads_per_rank} must be >= 0 (0 = auto)")
        self._check_nodes()
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError("backend='nccl' needs device='cuda' (or 'auto' on a GPU machine)")
        if self.fault != "none":
            if not 0 <= self.fault_rank < self.world_size:
                raise ValueError(f"fault_rank={self.fault_rank} must be in [0, {self.world_size})")
            if not 0 <= self.fault_step < self.steps:
                raise ValueError(f"fault_step={self.fault_step} must be in [0, {self.steps})")

    def _pick_mesh(self):
        """RunConfig(tp=2, cp=2, dp_shard=2): degrees named without a strategy run on the
        mesh, and a world size left at 1 is their product."""
        named = (self.cp > 1 or self.dp_shard > 0 or self.dp_replicate > 1 or self.ep > 1)
        if self.strategy == "single" and (named or self.tp > 1 or self.pp > 1):
            self.strategy = "mesh"
        if self.strategy == "mesh":
            for name in ("cp", "dp_replicate", "pp", "tp", "ep"):
                _positive_int(name, getattr(self, name))
            _positive_int("dp_shard", self.dp_shard, minimum=0)
            if self.world_size == 1:
                self.world_size = self.pp * self.dp_replicate * max(self.dp_shard, 1) * (
                    self.cp * self.tp)

    @property
    def pair_mbit(self) -> dict:
        """link_pairs as {(i, j): Mbit/s} (distlab.caller.cluster.Cluster's pair_mbit)."""
        out = {}
        for part in filter(None, (p.strip() for p in self.link_pairs.split(","))):
            try:
                nodes, mbit = part.split(":")
                i, j = (int(n) for n in nodes.split("-"))
                rate = float(mbit)
            except ValueError:
                raise ValueError(f"link_pairs={self.link_pairs!r}: write each pair as "
                                 "'i-j:Mbit/s', comma-separated, e.g. '0-1:25,1-2:50'") from None
            if not (0 <= i < self.nodes and 0 <= j < self.nodes and i != j) or not rate > 0:
                raise ValueError(f"link_pairs={self.link_pairs!r}: {part!r} needs two different "
                                 f"nodes of 0..{self.nodes - 1} and a rate > 0")
            out[(i, j)] = rate
        return out

    def _check_nodes(self):
        """Simulated nodes: whole ranks per node, a link with a rate, gloo on the CPU."""
        if not 1 <= self.nodes <= 32:
            raise ValueError(f"nodes={self.nodes} must be in [1, 32]")
        if not self.link_mbit > 0:
            raise ValueError(f"link_mbit={self.link_mbit} must be > 0 (Mbit/s)")
        if self.link_pairs and self.nodes == 1:
            raise ValueError(f"link_pairs={self.link_pairs!r} sets links between nodes: set "
                             "nodes >= 2")
        self.pair_mbit  # parses link_pairs, or raises saying how it is written
        if self.nodes == 1:
            return
        if self.processes < 2:
            raise ValueError(f"nodes={self.nodes}: {self.strategy} runs one process, so there "
                             "is nothing to place on several nodes")
        if self.processes % self.nodes:
            raise ValueError(f"nodes={self.nodes} must divide the {self.processes} rank "
                             f"processes of {self.strategy} at world_size={self.world_size}: "
                             "every node runs the same number of ranks")
        if self.device == "cuda" or self.backend == "nccl":
            raise ValueError("nodes > 1 simulates nodes on this machine's CPU with gloo: "
                             "device='cuda' and backend='nccl' are for real GPUs (run torchrun "
                             "on each node, as the README shows)")

    def _check_types(self):
        """Each field holds what it declares: an int is not a bool nor a float, a number is not
        a string, a float is finite; steps and sizes are not absurd."""
        for f in fields(self):
            value, kind = getattr(self, f.name), str(f.type)
            if kind == "bool":
                ok = isinstance(value, bool)
            elif kind == "int":
                ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            elif kind == "float":
                ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
                      and math.isfinite(value))
            else:
                ok = isinstance(value, str)
            if not ok:
                raise ValueError(f"{f.name}={value!r} must be {_KINDS[kind]}")
            if kind in ("int", "float"):  # NumPy's scalars as Python's: configs are JSON
                setattr(self, f.name, int(value) if kind == "int" else float(value))
        for name, most in _AT_MOST.items():
            if getattr(self, name) > most:
                raise ValueError(f"{name}={getattr(self, name)!r} is more than this tool is for "
                                 f"(at most {most:,})")

    def _check_knobs(self):
        """A knob only other strategies read would be ignored in silence: refuse it."""
        defaults = {f.name: f.default for f in fields(self)}
        for name, readers in KNOBS.items():
            if self.strategy not in readers and getattr(self, name) != defaults[name]:
                raise ValueError(f"{name}={getattr(self, name)!r}: strategy {self.strategy!r} "
                                 f"does not read it (only {', '.join(readers)}); leave it at "
                                 f"{defaults[name]!r}")
        if self.sync_bn and self.model == "gpt":
            raise ValueError("sync_bn=True: distlab's GPT has no BatchNorm (model='bnnet' or a "
                             "model of your own does)")

    def _check_experts(self):
        if not self.n_experts:
            if self.strategy == "ep":
                raise ValueError("strategy='ep' places the experts of a mixture of experts on "
                                 "the ranks: set n_experts (e.g. 4)")
            return
        if self.model != "gpt":
            raise ValueError(f"n_experts={self.n_experts} gives distlab's GPT mixture-of-experts "
                             f"blocks, not model={self.model!r}")
        if self.strategy not in MOE_STRATEGIES:
            raise ValueError(f"n_experts={self.n_experts}: a mixture of experts runs under "
                             f"{', '.join(MOE_STRATEGIES)} (the others split the blocks' MLP "
                             f"by its layer names), not strategy={self.strategy!r}")
        if self.n_experts < 2 or self.top_k not in (1, 2) or self.top_k > self.n_experts:
            raise ValueError(f"n_experts={self.n_experts}, top_k={self.top_k}: top_k is 1 or 2, "
                             "and at most n_experts (2 or more)")
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0")
        if self.lora_rank:
            raise ValueError("lora_rank with n_experts: the adapters target the dense MLP's "
                             "layers; use a dense model (n_experts=0)")
        groups = self.moe_groups or self.dp_degree
        if groups < 0 or groups % self.dp_degree or (self.micro_batch * self.seq_len) % (
                groups // self.dp_degree):
            raise ValueError(f"moe_groups={self.moe_groups} must be a multiple of the "
                             f"{self.dp_degree} data-parallel ranks and split each rank's "
                             f"{self.micro_batch * self.seq_len} tokens per forward evenly")

    @property
    def moe_groups_per_rank(self) -> int:
        """GShard's groups in one rank's forward."""
        return (self.moe_groups or self.dp_degree) // self.dp_degree

    def _check_model(self):
        """A built-in model, or a model and data factory named by import path (their import
        and a first forward are checked by launch(), distlab.models.factory.check)."""
        if not isinstance(self.model, str) or not isinstance(self.data, str):
            raise ValueError(f"model={self.model!r} and data={self.data!r} must be strings")
        if not factory.is_spec(self.model):
            if self.model not in MODELS:
                raise ValueError(f"model={self.model!r} is not one of: "
                                 f"{', '.join(map(repr, MODELS))}, nor 'package.module:function' "
                                 "(a model of your own, distlab.models.factory)")
            if self.data:
                raise ValueError(f"data={self.data!r} feeds a model of your own; model="
                                 f"{self.model!r} brings its data (set data='')")
            return
        factory.parse("model", self.model)
        if not self.data:
            raise ValueError(f"model={self.model!r} needs its data: set data='package.module:"
                             "function' (a function returning an object with "
                             "global_batch(step, batch) -> (x, y))")
        factory.parse("data", self.data)
        cls = strategy_class(self.strategy)
        if not cls.any_model:
            mine = [s for s in strategies() if strategy_class(s).any_model]
            raise ValueError(f"strategy={self.strategy!r} splits distlab's GPT by its layer "
                             f"names; a model of your own runs under: {', '.join(mine)}")
        gpt_only = [n for n in ("checkpointing", "lora_rank", "init_from", "task", "eval_every",
                                "dataset_size", "sp")
                    if getattr(self, n) not in (0, "", "none", False)]
        if gpt_only:
            raise ValueError(f"{', '.join(gpt_only)}: written for distlab's GPT and its data, "
                             f"not model={self.model!r} (sp: your tp_plan says where the "
                             "sequence is split)")

    def _check_checkpoints(self):
        _positive_int("checkpoint_every", self.checkpoint_every, minimum=0)
        _positive_int("keep_last", self.keep_last)
        if not (self.checkpoint_every or self.resume_from):
            if self.fault == "kill_in_save":
                raise ValueError("fault='kill_in_save' fires while a checkpoint is written: "
                                 "set checkpoint_every > 0")
            return
        if strategy_class(self.strategy).checkpoint_layout is None:
            raise ValueError(f"checkpointing is written for {', '.join(strategies('checkpoint'))} "
                             f"(got strategy={self.strategy!r}): set checkpoint_every=0 and "
                             "resume_from=''")
        if self.compress != "none":
            raise ValueError(f"compress={self.compress!r} keeps error-feedback residuals on each "
                             "rank that checkpoints do not hold, so a resume would not be exact")
        if self.join:
            raise ValueError("join=True: a rank out of data shadows the others' steps without "
                             "ending them, so it would miss their checkpoints; use drop_last")
        k = self.checkpoint_every
        if self.fault == "kill_in_save" and not (
                k and ((self.fault_step + 1) % k == 0 or self.fault_step == self.steps - 1)):
            raise ValueError(f"fault='kill_in_save' at fault_step={self.fault_step}: no checkpoint "
                             f"is written after that step (checkpoint_every={k} saves after "
                             f"steps {k - 1}, {2 * k - 1}, ... and the last, {self.steps - 1})")

    def _check_finetuning(self):
        for name in ("task", "lora_rank", "eval_every"):
            _positive_int(name, getattr(self, name), minimum=0)
        uses_gpt = [n for n in ("task", "lora_rank", "init_from") if getattr(self, n)]
        if uses_gpt and self.model != "gpt":
            raise ValueError(f"{', '.join(uses_gpt)}: fine-tuning is written for the GPT "
                             f"(model='gpt'), not model={self.model!r}")
        if self.lora_rank:
            if not self.lora_alpha > 0:
                raise ValueError(f"lora_alpha={self.lora_alpha} must be > 0")
            if self.lora_targets not in LORA_TARGETS:
                try:
                    re.compile(self.lora_targets)
                except re.error as e:
                    raise ValueError(f"lora_targets={self.lora_targets!r} is neither a preset "
                                     f"({', '.join(LORA_TARGETS)}) nor a regex: {e}") from None
        if not 0 <= self.replay < 1:
            raise ValueError(f"replay={self.replay} must be in [0, 1) (a fraction of each batch)")
        if self.ewc_lambda < 0:
            raise ValueError(f"ewc_lambda={self.ewc_lambda} must be >= 0 (0: off)")
        if (self.replay or self.ewc_lambda) and not self.task:
            raise ValueError("replay and ewc_lambda keep task 0 while training on another: "
                             "set task >= 1")
        if self.replay and self.dataset_size:
            raise ValueError("replay mixes rows into endless data; set dataset_size=0")
        if self.ewc_lambda:
            if not self.init_from:
                raise ValueError("ewc_lambda > 0 anchors the weights a run starts from: set "
                                 "init_from to the task-0 model's state dict")
            if self.loss_scale == "dynamic" or self.precision == "fp16":
                raise ValueError("ewc_lambda adds its gradient after the reduction, where "
                                 "loss-scaled gradients would need it scaled too; use "
                                 "fp32/bf16 without loss scaling")

    def _features_asked(self) -> dict[str, bool]:
        """Which of the optional features (distlab.parallel.base.FEATURES) this config asks for."""
        return {"finite_data": self.dataset_size > 0, "join": self.join,
                "lora": self.lora_rank > 0, "ewc": self.ewc_lambda > 0,
                "eval": self.eval_every > 0, "offload": self.offload,
                "grad_clip": self.grad_clip > 0, "loss_scaling": self.loss_scale == "dynamic"
                or (self.loss_scale == "auto" and self.precision == "fp16"),
                "sp": self.sp, "backup_workers": self.backup_workers > 0,
                "no_buffer_broadcast": not self.broadcast_buffers,
                "bugs": self.bug != "none", "diagnostics": self.diagnostics}

    def _check_features(self):
        """Every feature asked for must be one the strategy declares it supports."""
        cls = strategy_class(self.strategy)
        for feature, asked in self._features_asked().items():
            if asked and feature not in cls.supports:
                raise ValueError(f"{FEATURES[feature]}: strategy {self.strategy!r} does not "
                                 f"support it; strategies that do: "
                                 f"{', '.join(strategies(supporting=feature)) or 'none'}")

    def _check_debugging(self):
        _check_bug(self)  # a bug that would change something under this config
        if self.diagnostics and self._features_asked()["loss_scaling"]:
            raise ValueError("diagnostics=True measures gradient norms before the optimizer "
                             "step, where loss scaling leaves them scaled: use loss_scale='none' "
                             "(fp32 or bf16)")

    def _check_model_parallel(self):
        cls = strategy_class(self.strategy)
        tp = self.tp if "tp" in cls.degrees else 1
        pp = self.pp if "pp" in cls.degrees else 1
        if self.tp > 1 and tp == 1:
            raise ValueError(f"tp={self.tp}: tensor parallelism needs a strategy that splits "
                             f"the model by tp: {', '.join(_with_degree('tp'))}")
        if self.pp > 1 and pp == 1:
            raise ValueError(f"pp={self.pp}: pipeline parallelism needs a strategy that splits "
                             f"the model into stages: {', '.join(_with_degree('pp'))}")
        _positive_int("world_size", self.world_size)
        layouts = cls.layouts(self.world_size)  # the strategy's own rule (Strategy.layouts)
        if {"tp": tp, "pp": pp} not in layouts:
            runs = " or ".join(f"tp={d['tp']}, pp={d['pp']}" for d in layouts)
            raise ValueError(f"world_size={self.world_size} with tp={tp}, pp={pp}: strategy "
                             f"{self.strategy!r} runs {runs} at this world size")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(f"virtual_stages={self.virtual_stages}: only the interleaved "
                             f"schedule reads it (schedule={self.schedule!r} runs one model "
                             "chunk per rank); set schedule='interleaved' or virtual_stages=1")
        if self.n_head % tp or self.n_embd % tp:
            raise ValueError(f"n_head={self.n_head} and n_embd={self.n_embd} must divide by "
                             f"tp={tp} (each rank holds whole heads)")
        if self.n_layer % (pp * self.virtual_stages):
            raise ValueError(f"n_layer={self.n_layer} must divide into pp={pp} x "
                             f"virtual_stages={self.virtual_stages} equal stages")
        if self.sp and self.seq_len % tp:
            raise ValueError(f"seq_len={self.seq_len} must divide by tp={tp} for sp=True")
        if pp > 1 and self.schedule in ("1f1b", "interleaved") and self.microbatches < pp:
            raise ValueError(f"schedule={self.schedule!r} needs microbatches >= pp "
                             f"({self.microbatches} < {pp})")
        if pp > 1 and self.schedule == "interleaved" and self.microbatches % pp:
            raise ValueError(f"schedule='interleaved' needs microbatches divisible by pp "
                             f"({self.microbatches} by {pp}): micro-batches go round the "
                             "ranks in groups of pp")

    @property
    def dp_degree(self) -> int:
        """How many ranks split one global batch (the strategy's dp_degree: the workers of a
        parameter server, world/(tp·pp) under model parallelism, else the world)."""
        return strategy_class(self.strategy).dp_degree(self)

    @property
    def processes(self) -> int:
        """Processes to launch (`dp` runs its replicas as threads of one process)."""
        return strategy_class(self.strategy).processes(self)

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_degree

    @property
    def micro_batch(self) -> int:
        return self.global_batch // (self.dp_degree * self.grad_accum)

    def lr_at(self, step: int) -> float:
        """Linear warm-up over warmup_steps (Goyal et al. 2017, "gradual warmup"), then lr."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        return self.lr

    def replace(self, **changes) -> "RunConfig":
        """A copy with some fields changed (validated again). When the strategy changes, the
        knobs only the old one read (parallel.KNOBS: microbatches for a pipeline, bucket_mb for
        DDP, ...) go back to their defaults unless given: the same run under another strategy,
        not a config the new strategy would refuse for a knob it does not read."""
        new = changes.get("strategy", self.strategy)
        if new != self.strategy:
            defaults = {f.name: f.default for f in fields(self)}
            for name, readers in KNOBS.items():
                if name not in changes and new not in readers:
                    changes[name] = defaults[name]
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        if not isinstance(d, dict):
            raise ValueError(f"a RunConfig is read from a dict, not {type(d).__name__}")
        d = dict(d)
        # configs written before every knob was a field kept some in "extra": read them as fields
        extra = d.pop("extra", {})
        if not isinstance(extra, dict):
            raise ValueError(f"extra={extra!r} must be a dict of RunConfig fields")
        d.update({_LEGACY_EXTRA.get(k, k): v for k, v in extra.items()})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown RunConfig field(s): {', '.join(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)


_LEGACY_EXTRA = {"classes": "bn_classes", "features": "bn_features",
                 "cluster_std": "bn_cluster_std", "separation": "bn_separation"}


_KINDS = {"bool": "True or False", "int": "an integer (not a bool)",
          "float": "a finite number", "str": "a string"}
# Beyond these a run would not finish on any machine this workbook runs on (nor fit in memory:
# launch() also checks the estimate against this machine's RAM)
_AT_MOST = {"steps": 10_000_000, "world_size": 4096, "global_batch": 1 << 24,
            "seq_len": 1 << 20, "n_layer": 10_000, "n_experts": 1024, "n_embd": 1 << 20,
            "vocab_size": 1 << 24, "dataset_size": 1 << 31, "epochs": 100_000}


def _with_degree(degree: str) -> list[str]:
    return [s for s in strategies() if degree in strategy_class(s).degrees]


def _choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of: {', '.join(map(repr, choices))}")


def _positive_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


MOE_STRATEGIES = ("single", "allreduce", "ddp", "ep", "mesh")


def _check_bug(cfg) -> None:
    """Refuse a bug that would change nothing under this config, or that a checkpoint could
    not resume (the name is already one of BUGS)."""
    if cfg.bug == "no_zero_grad" and (cfg.checkpoint_every or cfg.resume_from):
        raise ValueError("bug='no_zero_grad' carries gradients from step to step, which "
                         "checkpoints do not hold: set checkpoint_every=0 and resume_from=''")
    if cfg.bug == "loss_not_divided" and cfg.grad_accum < 2:
        raise ValueError("bug='loss_not_divided' leaves out the division by grad_accum: set "
                         f"grad_accum >= 2 (got {cfg.grad_accum}, where dividing changes nothing)")
    if cfg.bug == "same_rows" and cfg.dp_degree < 2:
        raise ValueError("bug='same_rows' makes every rank read rank 0's rows: it needs "
                         f"world_size >= 2 (got {cfg.world_size})")
    if cfg.bug == "shuffled_labels" and cfg.local_batch < 2:
        raise ValueError("bug='shuffled_labels' gives each row another row's targets: it needs "
                         f"at least 2 rows per rank (global_batch={cfg.global_batch} over "
                         f"{cfg.dp_degree} rank(s))")
