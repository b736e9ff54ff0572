"""A parallelism planner by formula: which dp × tp × pp layout (and, where asked, × cp context
parallel × ep expert parallel), ZeRO stage, micro-batch and recomputation fit a model on a
cluster, and which is fastest per step.

Pure arithmetic on distlab.theory.estimate (memory) and distlab.comm (the α-β link model); nothing is
launched. Every figure is an estimate under the assumptions named below; rank with it, then
measure the top few.

Sources:
  FLOPs    Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", Section 2.1) and
           Hoffmann et al. 2022 (Chinchilla): training costs C ≈ 6·N·D FLOPs (forward 2ND,
           backward 4ND). Narayanan et al. 2021 (Megatron-LM, Section 5.1) count 8·N·D with
           full recomputation (one more forward): their 34 days for GPT-3 is 8ND/(n·X).
  Memory   model states: Rajbhandari et al. 2020 (ZeRO), estimate.zero_model_states over the
           data-parallel group, Ψ/(t·p) parameters per GPU (Megatron splits every layer t ways
           and the layers p ways; embeddings are spread as evenly as the layers: an
           approximation). Activations: Korthikanti et al. 2022 per layer
           (estimate.korthikanti_layer_activation_bytes) × L/p layers per stage × micro-batches
           in flight: 1F1B's first stage holds min(m, p) of them (Narayanan et al. 2021,
           Section 2.2.1; Korthikanti et al. Section 4.2.3); GPipe holds all m. With full
           recomputation one layer's whole activations are rebuilt during its backward: one
           layer without recomputation is added. Embedding/logit activations are not counted.
  Time     compute 6·N·tokens/(G·peak·mfu) × (1 + recompute overhead): full adds a forward,
           2N of 6N = +1/3; selective recomputes only the attention core, by Korthikanti et
           al.'s FLOP count (Section 5 and Appendix A): model FLOPs 72Bslh²(1 + s/(6h) +
           V/(12hl)), with selective recomputation 72Bslh²(1 + s/(3h) + V/(12hl)), so
           +(s/(6h)) / (1 + s/(6h) + V/(12hl)): 2.7% for GPT-3 175B, 1.6% for MT-NLG 530B,
           their figures (see recompute_overhead).
           Pipeline bubble (1F1B and GPipe alike): (p-1)/m of the compute, i.e. (p-1)/(m+p-1)
           of the total (Narayanan et al. 2021, Section 2.2). With the backward split into B
           and W and F = B = W, each a third of a micro-batch's stage compute (backward twice
           a forward, halved; Qi et al. 2024's setting): ZB-H1 (zb1p) (p-1)(F+B-2W) with B the
           whole backward, (p-1)/(3m); ZBV (zbv) the V's fill, p-1 chunk forwards, (p-1)/(6m),
           priced only when m >= 2p (distlab.parallel.pipeline.pp.bubble_formula); DualPipeV
           (dualpipev) as its order idles when run (pp.simulate: p-1 chunk units, (p-1)/(6m),
           below the (p-1)/(3m) of DeepSeek-AI's table, a bound), m >= 2p. The all-to-all
           DualPipe hides behind its F&B pairs is not priced: it stays exposed, a bound.
           Communication, α-β (comm.ring_allreduce_time), none of it overlapped unless said:
             DP   stages 0-2: one ring all-reduce per step of the stage's 2-byte gradients
                  (ZeRO-1/2's reduce-scatter + all-gather move the same bytes); stage 3: per
                  micro-batch an all-gather of parameters in forward and in backward and a
                  reduce-scatter of gradients, 3(n-1) messages of S/n (ZeRO paper Section 7:
                  1.5× plain DP's volume). `dp_overlap` is the fraction hidden behind backward
                  (default 0: fully exposed, an upper bound; PyTorch DDP and ZeRO overlap much
                  of it in practice). Over the inter-node link when the group spans nodes.
             TP   4 all-reduces of b·s·h·2 bytes per layer per micro-batch (2 forward, 2
                  backward: Shoeybi et al. 2019, Megatron-LM Figure 4; with sequence
                  parallelism the all-gather + reduce-scatter pairs move the same bytes,
                  Korthikanti et al. Section 4.2.2); full recomputation adds the forward's 2.
                  Over the intra-node link while tp fits in a node, else the inter-node one
                  (plan() never splits tp across nodes; evaluate() prices it). Exposed: on the
                  critical path.
             PP   per micro-batch one activation forward and one gradient back between
                  stages, b·s·h·2/t bytes each (Narayanan et al. Section 4.1's scatter/gather),
                  along the m + p - 1 slots of the critical path; exposed.
           Rank order (Megatron's): tp innermost, then dp, then pp. A dp group leaves its
           node when t·dp > GPUs per node; pipeline neighbours when t·dp >= GPUs per node.
  Five dimensions (cps=, eps= of plan(); 1 by default, so the 3D results above stand):
           CP   context parallelism over cp ranks splits every sequence: each GPU holds s/cp
                tokens of every activation (Korthikanti's per-layer bytes at s/cp), while the
                model states do not shrink; the ranks of a cp group hold the same parameters,
                so the gradient (and ZeRO's sharding) group is dp·cp. Per layer and
                micro-batch a ring of cp ranks sends K and V (b·s/cp·h/t each) over cp-1 hops
                forward, K, V, dK and dV over cp-1 hops and dK, dV once more backward
                (distlab.theory.context_and_experts.ring_attention_bytes; Liu et al. 2023),
                counted exposed unless cp_overlap says how much hides behind attention. Rank
                order: tp innermost, then cp, then dp, then pp (cp stays inside a node while
                tp·cp fits in one).
           EP   a mixture of experts (Model.experts, top_k, capacity_factor): parameters
                Ψ_dense + L·E·8h² (each expert an h×4h and a 4h×h matrix), FLOPs per token
                6·(Ψ_dense + L·k·8h²) (Fedus et al. 2021: the parameters grow with E, the
                work with k). Expert parallelism over ep ranks carved from the data-parallel
                group (Megatron-Core's expert data parallelism): each GPU holds E/ep experts,
                their states sharded over dp·cp/ep replicas. Per MoE layer and micro-batch
                four all-to-alls (dispatch and combine, forward and backward), each sending
                (ep-1)/ep of the b·s/cp·k·cf rows of h/t (ep_dispatch_bytes; GShard, Lepikhin
                et al. 2020), exposed, inside a node while tp·cp·ep fits in one. The experts' activations: the MLP's 19·sbh/t bytes of
                Korthikanti's 34 held once per routed copy, k·cf copies.
  Limits   DeepSpeed refuses ZeRO-2/3 together with pipeline parallelism (its pipeline engine
           accumulates whole gradients across micro-batches): by default only stages 0-1 are
           combined with p > 1 (Megatron's distributed optimizer is ZeRO-1).
           `offload` (ZeRO-Offload) moves bytes off the device; its PCIe traffic and CPU
           optimizer step are not timed. `mfu` is held constant across layouts: the lower
           matmul efficiency of small micro-batches or thin tensor-parallel shards is not
           modelled, so near-ties in the ranking (within a few %) are not meaningful.
  FP8      Cluster(peak_flops=H100_FP8_FLOPS) and gather_bytes=1: the matmuls at the FP8 peak,
           ZeRO-3's two all-gathers at one byte a parameter (torchao's float8 all-gather;
           the per-weight scales, 4 bytes a weight, are left out), its reduce-scatter still
           at value_bytes. The model states stay `bpp`'s (FP8 training keeps higher-precision
           masters, gradients and optimizer state: pass the recipe's bytes).
  Peaks    A100 SXM bf16 dense 312 TFLOP/s, 80 GB HBM2e; H100 SXM bf16 dense 989 TFLOP/s,
           fp8 dense 1979, 80 GB HBM3 (NVIDIA datasheets). InfiniBand HDR 200 Gb/s per port, one port per GPU
           on a DGX A100 (NVIDIA DGX A100 datasheet: 8× ConnectX-6 200 Gb/s).

    from distlab.theory.plan import Model, Cluster, plan, best, training_time, GPT3_175B
    rows = plan(GPT3_175B, Cluster(gpus=1536), global_batch=1536, mfu=0.5)
    rows[0]           # the fastest layout that fits, with its memory and time breakdown
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from distlab.comm import LINKS, Link, ring_allreduce_time
from distlab.theory.context_and_experts import ep_dispatch_bytes, ring_attention_bytes
from distlab.theory.estimate import (MIXED_ADAM, BytesPerParam, korthikanti_layer_activation_bytes,
                              narayanan_params, zero_model_states)
from distlab.units import GB

A100_BF16_FLOPS = 312e12  # NVIDIA A100 datasheet: bf16 tensor core, dense
H100_BF16_FLOPS = 989e12  # NVIDIA H100 SXM datasheet: bf16 tensor core, dense
H100_FP8_FLOPS = 1979e12  # NVIDIA H100 SXM datasheet: fp8 tensor core, dense (3958 sparse)
IB_HDR = Link("InfiniBand HDR", 5e-6, 25e9,
              "InfiniBand HDR: 200 Gb/s per port (ConnectX-6); DGX A100: one port per GPU")
RECOMPUTE = ("none", "selective", "full")
DAY = 86400.0


# -- inputs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    """A GPT shape; `n_params` overrides the dense count (else Narayanan et al.'s formula).
    experts > 0: every layer's MLP is a mixture of that many experts, top_k per token."""
    n_layer: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200
    n_params: float | None = None
    experts: int = 0
    top_k: int = 1
    capacity_factor: float = 1.0

    @property
    def dense_params(self) -> float:
        """The model with one MLP per layer (the count n_params or Narayanan's gives)."""
        if self.n_params is not None:
            return float(self.n_params)
        return narayanan_params(self.n_layer, self.hidden, self.vocab, self.seq)

    @property
    def expert_params(self) -> float:
        """All experts' weights (0 for a dense model): L·E·8h²."""
        return self.n_layer * self.experts * 8 * self.hidden ** 2

    @property
    def params(self) -> float:
        """Every parameter: the dense count with each MLP replaced by E experts."""
        if not self.experts:
            return self.dense_params
        return self.dense_params + self.expert_params - self.n_layer * 8 * self.hidden ** 2

    @property
    def active_params(self) -> float:
        """The parameters one token meets (what sets the FLOPs): k experts per layer."""
        if not self.experts:
            return self.dense_params
        return self.dense_params + (self.top_k - 1) * self.n_layer * 8 * self.hidden ** 2


# GPT-3 (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads, context 2048.
GPT3_175B = Model(96, 12288, 96, 2048, 51200)


@dataclass(frozen=True)
class Cluster:
    """GPUs, how many share a node (and its intra-node link), memory and peak FLOP/s per GPU.
    `usable` is the fraction of memory the planner may fill (allocator fragmentation, CUDA
    context and communication buffers take the rest)."""
    gpus: int
    gpus_per_node: int = 8
    memory: float = 80 * GB
    intra: Link = LINKS["NVLink 3 (A100)"]
    inter: Link = IB_HDR
    peak_flops: float = A100_BF16_FLOPS
    usable: float = 1.0


# -- helpers -----------------------------------------------------------------------------------
def training_flops(n_params: float, tokens: float, flops_per_param_token: float = 6.0) -> float:
    """C = 6·N·D (Kaplan et al. 2020; Chinchilla). 8 with full recomputation (Narayanan)."""
    return flops_per_param_token * n_params * tokens


def training_time(n_params: float, tokens: float, gpus: int, peak_flops: float, mfu: float,
                  flops_per_param_token: float = 6.0) -> float:
    """Seconds: 6·N·D / (gpus · peak · mfu). peak·mfu is the achieved FLOP/s per GPU."""
    return training_flops(n_params, tokens, flops_per_param_token) / (gpus * peak_flops * mfu)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: Model, cluster: Cluster, cps=(1,), eps=(1,)):
    """(dp, tp, pp, cp, ep): dp·tp·pp·cp = GPUs, tp dividing the node and the heads, pp the
    layers; cp cuts the sequence into 2·cp equal chunks (the zig-zag split); ep divides dp and
    the experts (ep > 1 only for a mixture). cps = eps = (1,): the 3D layouts."""
    for tp in divisors(cluster.gpus_per_node):
        if model.heads % tp:
            continue
        for pp in divisors(model.n_layer):
            for cp in cps:
                if cluster.gpus % (tp * pp * cp) or (cp > 1 and model.seq % (2 * cp)):
                    continue
                dp = cluster.gpus // (tp * pp * cp)
                for ep in eps:
                    if ep == 1 or (model.experts and dp % ep == 0 and model.experts % ep == 0):
                        yield dp, tp, pp, cp, ep


def recompute_overhead(model: Model, recompute: str) -> float:
    """Extra compute as a fraction of the model's own FLOPs: none 0; full +1/3; selective
    (s/(6h)) / (1 + s/(6h) + V/(12hl)).

    Full: one more forward, 2N of 6N (Narayanan et al. 2021's 8·N·D). Korthikanti et al.
    2022's exact count, 96Bslh²(1 + s/(6h) + V/(16hl)) over 72Bslh²(1 + s/(6h) + V/(12hl))
    (the logit layer is not recomputed), is 33.2% for GPT-3 175B: 1/3 to 0.1 point.

    Selective: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", Section 5 and Appendix A) count an iteration's model FLOPs as
    72Bslh²(1 + s/(6h) + V/(12hl)) and, with the attention core (QKᵀ, softmax, dropout,
    softmax·V) recomputed, 72Bslh²(1 + s/(3h) + V/(12hl)): the attention-score term
    s/(6h), i.e. 12Bs²h per layer, counted once more. Their ratio less one gives the
    paper's own overheads: 2.7% for GPT-3 175B and 1.6% for MT-NLG 530B. (A stricter
    count, one extra forward of the two s² matmuls, 4Bs²h per layer, is a third of this;
    we follow the paper.)"""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if recompute == "full":
        return 1 / 3
    if recompute == "selective":
        s, h, n_layer, v = model.seq, model.hidden, model.n_layer, model.vocab
        attention = s / (6 * h)
        return attention / (1 + attention + v / (12 * h * n_layer))
    return 0.0


# -- one candidate -----------------------------------------------------------------------------
@dataclass
class Row:
    dp: int
    tp: int
    pp: int
    zero: int
    micro_batch: int
    recompute: str
    micro_batches: int
    states: float
    activations: float
    memory: float
    fits: bool
    compute_s: float
    bubble_s: float
    dp_comm_s: float
    tp_comm_s: float
    pp_comm_s: float
    step_s: float
    tokens_per_step: int
    tokens_per_s: float
    mfu: float  # achieved model-FLOPs utilisation: 6N·tokens / (step · GPUs · peak)
    cp: int = 1
    ep: int = 1
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0
    schedule: str = "1f1b"

    def as_dict(self) -> dict:
        return asdict(self)


def memory_per_gpu(model: Model, cluster: Cluster, dp: int, tp: int, pp: int, zero: int,
                   micro_batch: int, recompute: str, micro_batches: int,
                   sequence_parallel: bool = True, schedule: str = "1f1b",
                   bpp: BytesPerParam = MIXED_ADAM, offload=(), cp: int = 1,
                   ep: int = 1) -> tuple[float, float]:
    """(model-state bytes, activation bytes) on the busiest GPU (the first pipeline stage)."""
    dense = model.params - model.expert_params  # the experts are sharded apart (ep)
    states = zero_model_states(dense / (tp * pp), dp * cp, zero, bpp, offload).device
    if model.experts:
        states += zero_model_states(model.expert_params / (tp * pp * ep), dp * cp // ep, zero,
                                    bpp, offload).device
    sp = sequence_parallel and tp > 1
    s, b, h, a = model.seq // cp, micro_batch, model.hidden, model.heads
    layer = korthikanti_layer_activation_bytes(s, b, h, a, tp, sp, recompute)
    if model.experts and recompute != "full":  # each routed copy holds the MLP's 19·sbh/t
        layer += (model.top_k * model.capacity_factor - 1) * 19 * s * b * h / tp
    in_flight = IN_FLIGHT[schedule](micro_batches, pp)
    acts = layer * (model.n_layer // pp) * in_flight
    if recompute == "full":  # the layer being recomputed holds its whole activations
        acts += korthikanti_layer_activation_bytes(s, b, h, a, tp, sp, "none")
    return states, acts


def dp_comm_time(model: Model, cluster: Cluster, dp: int, tp: int, pp: int, zero: int,
                 micro_batches: int, grad_bytes: int = 2, params: float | None = None,
                 gather_bytes: int | None = None) -> float:
    """Seconds of DP communication per step (ring α-β, whole buffer as one collective) over
    `dp` replicas of `params` (default: the whole model). gather_bytes: bytes per parameter
    ZeRO-3's all-gathers carry (default grad_bytes; 1: FP8 weights)."""
    if dp == 1:
        return 0.0
    link = cluster.inter if tp * dp > cluster.gpus_per_node else cluster.intra
    n = (model.params if params is None else params) / (tp * pp)
    if zero < 3:
        return ring_allreduce_time(n * grad_bytes, dp, link)
    # all-gather (fwd) + all-gather (bwd) + reduce-scatter per micro-batch, each half an
    # all-reduce
    gathered = n * (grad_bytes if gather_bytes is None else gather_bytes)
    return micro_batches * 0.5 * (2 * ring_allreduce_time(gathered, dp, link)
                                  + ring_allreduce_time(n * grad_bytes, dp, link))


def tp_comm_time(model: Model, cluster: Cluster, tp: int, pp: int, micro_batch: int,
                 micro_batches: int, recompute: str, act_bytes: int = 2) -> float:
    if tp == 1:
        return 0.0
    per_layer = 6 if recompute == "full" else 4
    msg = micro_batch * model.seq * model.hidden * act_bytes
    n = micro_batches * (model.n_layer // pp) * per_layer
    link = cluster.inter if tp > cluster.gpus_per_node else cluster.intra
    return n * ring_allreduce_time(msg, tp, link)


def pp_comm_time(model: Model, cluster: Cluster, dp: int, tp: int, pp: int, micro_batch: int,
                 micro_batches: int, act_bytes: int = 2) -> float:
    if pp == 1:
        return 0.0
    link = cluster.inter if tp * dp >= cluster.gpus_per_node else cluster.intra
    msg = micro_batch * model.seq * model.hidden * act_bytes / tp
    return 2 * (micro_batches + pp - 1) * (link.alpha_s + msg / link.bandwidth_Bps)


def cp_comm_time(model: Model, cluster: Cluster, tp: int, pp: int, cp: int, micro_batch: int,
                 micro_batches: int, act_bytes: int = 2) -> float:
    """Seconds of ring-attention traffic per step: per layer and micro-batch the ring's hops
    (α each) and its bytes (ring_attention_bytes over h/t) on the cp group's link."""
    if cp == 1:
        return 0.0
    link = cluster.inter if tp * cp > cluster.gpus_per_node else cluster.intra
    ring = ring_attention_bytes(micro_batch, model.seq, model.hidden // tp, cp, act_bytes)
    hops = (cp - 1) + cp  # forward's, then backward's (K/V and their gradients travel together)
    per_layer = hops * link.alpha_s + (ring["forward"] + ring["backward"]) / link.bandwidth_Bps
    return micro_batches * (model.n_layer // pp) * per_layer


def ep_comm_time(model: Model, cluster: Cluster, tp: int, pp: int, cp: int, ep: int,
                 micro_batch: int, micro_batches: int, act_bytes: int = 2) -> float:
    """Seconds of all-to-all per step: per MoE layer and micro-batch four all-to-alls, each
    (ep-1) messages (α) and ep_dispatch_bytes' rows (k·cf per token) of h/t."""
    if ep == 1 or not model.experts:
        return 0.0
    link = cluster.inter if tp * cp * ep > cluster.gpus_per_node else cluster.intra
    rows = micro_batch * (model.seq // cp) * model.capacity_factor
    a2a = ep_dispatch_bytes(int(rows), model.hidden // tp, ep, model.top_k, act_bytes)
    per_layer = 4 * (ep - 1) * link.alpha_s + (a2a["forward"] + a2a["backward"]) / \
        link.bandwidth_Bps
    return micro_batches * (model.n_layer // pp) * per_layer


# micro-batches whose activations a pipeline stage holds at once: GPipe all m; 1F1B and ZB-H1
# at most p (ZB-H1 counts those whose W is pending); ZBV 2p + 2 chunks of half a stage;
# DualPipeV 2p + 1 chunks (DeepSeek-AI's table: PP + 1 with PP = 2p stages)
IN_FLIGHT = {"gpipe": lambda m, p: m, "1f1b": lambda m, p: min(m, p),
             "zb1p": lambda m, p: min(m, p), "zbv": lambda m, p: min(m, p + 1),
             "dualpipev": lambda m, p: min(m, p + 0.5)}


def bubble_share(schedule: str, p: int, m: int) -> float | None:
    """The bubble as a share of the step's compute (module docstring); None where the schedule
    is not priced (zbv with m < 2p) or cannot run here (zb1p with m < p, as 1F1B's warm-up
    needs; dualpipev with m < 2p)."""
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "zb1p":
        return (p - 1) / (3 * m) if m >= p else None
    if schedule in ("zbv", "dualpipev"):
        return (p - 1) / (6 * m) if m >= 2 * p else None
    raise ValueError(f"schedule {schedule!r}: the planner prices {', '.join(IN_FLIGHT)}")


def evaluate(model: Model, cluster: Cluster, global_batch: int, dp: int, tp: int, pp: int,
             zero: int, micro_batch: int, recompute: str, mfu: float, dp_overlap: float = 0.0,
             sequence_parallel: bool = True, schedule: str = "1f1b",
             bpp: BytesPerParam = MIXED_ADAM, offload=(), cp: int = 1, ep: int = 1,
             cp_overlap: float = 0.0, value_bytes: int = 2,
             gather_bytes: int | None = None) -> Row | None:
    """One candidate's memory and step time; None when the batch does not split evenly.
    value_bytes: bytes of each gradient and activation value sent (2: bf16; 4: fp32).
    gather_bytes: bytes per parameter of ZeRO-3's all-gathers (default value_bytes; 1: FP8
    weights, as torchao's float8 all-gather)."""
    if dp * tp * pp * cp != cluster.gpus or global_batch % (dp * micro_batch):
        return None
    m = global_batch // (dp * micro_batch)
    share = bubble_share(schedule, pp, m)
    if share is None:
        return None
    states, acts = memory_per_gpu(model, cluster, dp, tp, pp, zero, micro_batch, recompute, m,
                                  sequence_parallel, schedule, bpp, offload, cp, ep)
    mem = states + acts
    tokens = global_batch * model.seq
    ideal = training_time(model.active_params, tokens, cluster.gpus, cluster.peak_flops, mfu)
    compute = ideal * (1 + recompute_overhead(model, recompute))
    bubble = compute * share
    dense = model.params - model.expert_params
    dpc = dp_comm_time(model, cluster, dp * cp, tp, pp, zero, m, value_bytes, params=dense,
                       gather_bytes=gather_bytes)
    if model.experts:  # the experts' gradients over their replicas only
        dpc += dp_comm_time(model, cluster, dp * cp // ep, tp, pp, zero, m, value_bytes,
                            params=model.expert_params / ep, gather_bytes=gather_bytes)
    dpc *= 1 - dp_overlap
    tpc = tp_comm_time(model, cluster, tp, pp, micro_batch, m, recompute, value_bytes)
    ppc = pp_comm_time(model, cluster, dp, tp, pp, micro_batch, m, value_bytes)
    cpc = cp_comm_time(model, cluster, tp, pp, cp, micro_batch, m) * (1 - cp_overlap)
    epc = ep_comm_time(model, cluster, tp, pp, cp, ep, micro_batch, m)
    step = compute + bubble + dpc + tpc + ppc + cpc + epc
    return Row(dp, tp, pp, zero, micro_batch, recompute, m, states, acts, mem,
               mem <= cluster.memory * cluster.usable, compute, bubble, dpc, tpc, ppc, step,
               tokens, tokens / step,
               training_flops(model.active_params, tokens)
               / (step * cluster.gpus * cluster.peak_flops), cp, ep, cpc, epc, schedule)


# -- the search --------------------------------------------------------------------------------
def plan(model: Model, cluster: Cluster, global_batch: int, mfu: float = 0.5,
         zero_stages=(0, 1, 2, 3), recomputes=RECOMPUTE, micro_batches=None,
         fits_only: bool = True, zero23_with_pp: bool = False, cps=(1,), eps=(1,),
         schedules=None, **kw) -> list[Row]:
    """Every layout × ZeRO stage × micro-batch × recompute (× schedule, with `schedules`:
    e.g. ("1f1b", "zb1p", "zbv", "dualpipev"), tried where pp > 1); those that fit
    (fits_only), fastest first (ties: less memory). micro_batches: candidate sizes (default
    powers of two up to the per-replica batch). cps, eps: the context- and expert-parallel
    sizes to try (default 1: the 3D search). kw: dp_overlap, cp_overlap, sequence_parallel,
    schedule, bpp, offload, value_bytes, gather_bytes."""
    if schedules is not None:
        return sorted((r for sc in schedules for r in plan(
            model, cluster, global_batch, mfu, zero_stages, recomputes, micro_batches,
            fits_only, zero23_with_pp, cps, eps, schedule=sc, **kw)
            if r.pp > 1 or sc == schedules[0]), key=lambda r: (r.step_s, r.memory))
    rows = []
    for dp, tp, pp, cp, ep in layouts(model, cluster, cps, eps):
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        bs = micro_batches or [1 << i for i in range(per_replica.bit_length())]
        for zero in zero_stages:
            if pp > 1 and zero >= 2 and not zero23_with_pp:
                continue
            for b in bs:
                for rc in recomputes:
                    r = evaluate(model, cluster, global_batch, dp, tp, pp, zero, b, rc, mfu,
                                 cp=cp, ep=ep, **kw)
                    if r is not None and (r.fits or not fits_only):
                        rows.append(r)
    return sorted(rows, key=lambda r: (r.step_s, r.memory))


def best(model: Model, cluster: Cluster, global_batch: int, mfu: float = 0.5,
         **kw) -> Row | None:
    """The fastest layout that fits, or None when nothing does."""
    rows = plan(model, cluster, global_batch, mfu, **kw)
    return rows[0] if rows else None


def max_micro_batch(model: Model, cluster: Cluster, dp: int, tp: int, pp: int, zero: int,
                    recompute: str, limit: int = 4096, **kw) -> int:
    """The largest micro-batch (sequences per GPU) that fits with m = pp micro-batches in
    flight; 0 when not even one does."""
    def fits(b):
        st, ac = memory_per_gpu(model, cluster, dp, tp, pp, zero, b, recompute, pp, **kw)
        return st + ac <= cluster.memory * cluster.usable
    best_b = 0
    for b in range(1, limit + 1):
        if not fits(b):
            break
        best_b = b
    return best_b


def table(rows, n: int = 10) -> str:
    """The first n rows as text: layout, memory (GB), step seconds and its parts, tokens/s."""
    head = (f"{'dp':>4} {'tp':>2} {'pp':>3} {'Z':>1} {'b':>3} {'recompute':>9} {'m':>4} "
            f"{'mem GB':>7} {'step s':>7} {'comp':>6} {'bubble':>6} {'dp':>6} {'tp':>6} "
            f"{'pp':>6} {'tok/s':>9} {'MFU':>5}")
    lines = [head]
    for r in rows[:n]:
        lines.append(f"{r.dp:>4} {r.tp:>2} {r.pp:>3} {r.zero:>1} {r.micro_batch:>3} "
                     f"{r.recompute:>9} {r.micro_batches:>4} {r.memory / GB:>7.1f} "
                     f"{r.step_s:>7.2f} {r.compute_s:>6.2f} {r.bubble_s:>6.2f} "
                     f"{r.dp_comm_s:>6.2f} {r.tp_comm_s:>6.2f} {r.pp_comm_s:>6.2f} "
                     f"{r.tokens_per_s:>9.0f} {r.mfu:>5.2f}")
    return "\n".join(lines)
