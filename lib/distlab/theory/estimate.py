"""Memory by formula: the analytic side of distlab.memory's measurements.

Every function returns **bytes**. To print, divide by a unit and say which:

    GB  = 1e9     (distlab.units) decimal; the ZeRO paper (Rajbhandari et al. 2020) reports GB = 1e9 bytes
                  (7.5B parameters x 16 bytes = 120 GB), and so do Korthikanti et al. 2022
    GiB = 2**30   binary; what tools on a machine (and distlab's figures, in MiB) show

Sources, and what each formula here reproduces (tests/test_estimate.py checks every one):

  Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models" (SC'20), Section 5 / Figure 1: model states per data-parallel rank for Ψ parameters,
  N_d ranks and K bytes of optimizer state per parameter (mixed-precision Adam: fp16 params
  and grads, 2+2 bytes; fp32 master params, momentum and variance, K = 12):
      plain DP        (2 + 2 + K)Ψ              7.5B, N_d=64: 120 GB
      P_os   (ZeRO-1)  2Ψ + 2Ψ + KΨ/N_d                           31.4 GB
      P_os+g (ZeRO-2)  2Ψ + (2 + K)Ψ/N_d                          16.6 GB
      P_os+g+p (ZeRO-3) (2 + 2 + K)Ψ/N_d                           1.9 GB
  zero_model_states() takes any bytes-per-parameter mix (BytesPerParam) and CPU offload.

  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (MLSys 2023), Section 4 (Eqs. 1-3), Table 2 and Section 5: activation bytes per transformer
  layer, 16-bit activations with dropout, s sequence, b micro-batch, h hidden, a heads, t
  tensor-parallel size:
      no parallelism                      sbh(34 + 5as/h)
      tensor parallel                     sbh(10 + 24/t + 5as/(ht))
      tensor + sequence parallel          sbh/t (34 + 5as/h)
      selective recomputation             sbh(10 + 24/t), or 34sbh/t with sequence parallel
      full recomputation                  2sbh
  korthikanti_layer_activation_bytes().

  Parameter counts: the papers' 12·L·h² (a layer's four h×h attention matrices and two
  h×4h MLP matrices), and Narayanan et al. 2021 ("Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", Section 5.1): P = 12Lh²(1 + 13/(12h) +
  (V + s)/(12Lh)) with biases, LayerNorms and tied embeddings; gpt_params() counts our GPT
  exactly (separate q/k/v/o, any MLP width, untied head, learned positions).

  This project's runs (fp32): run_model_state_bytes() (single, allreduce, ddp, ddp-torch;
  zero1/2/3 with distlab.parallel.zero.stages's padded flat buffers) and gpt_activation_bytes() (our
  GPT, checkpointing none/selective/full) are derived for our model and loop, and equal what
  the ranks measure (Strategy.state_bytes, ActivationMeter) byte for byte.
  fp32_adamw_state_bytes() counts the same on a module with frozen values (LoRA, Hu et al.
  2021): gradients and AdamW state follow the trainable values only.

A notebook's "textbook vs measured" table:

    from distlab.theory.estimate import estimate_run, zero_table
    from distlab.units import GB, MiB
    zero_table(7.5e9, 64)                  # {stage: bytes}: 120e9, 31.4e9, 16.6e9, 1.9e9
    estimate_run(cfg)                      # {params, grads, optim, activations} for rank 0
    run.history("step")[-1]["memory"]      # what the rank measured, same keys
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from distlab.config import RunConfig
from distlab.models import GPT, GPTConfig
from distlab.parallel import strategies, strategy_class


# -- model states: the ZeRO paper ----------------------------------------------------------
@dataclass(frozen=True)
class BytesPerParam:
    """Bytes each parameter costs in parameters, gradients and optimizer state (K)."""
    params: float
    grads: float
    optim: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optim


# The ZeRO paper's mixed-precision Adam: fp16 params and grads; fp32 master copy, momentum and
# variance (K = 4 + 4 + 4 = 12). bf16 training with fp32 master weights is the same mix.
MIXED_ADAM = BytesPerParam(2, 2, 12)
# Plain fp32 training with Adam(W): momentum and variance only (the params are the master copy).
FP32_ADAM = BytesPerParam(4, 4, 8)
FP32_SGD = BytesPerParam(4, 4, 0)  # SGD without momentum keeps no state

STAGES = {0: "plain DP", 1: "P_os (ZeRO-1)", 2: "P_os+g (ZeRO-2)", 3: "P_os+g+p (ZeRO-3)"}
OFFLOADABLE = ("params", "grads", "optim")


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank of parameters, gradients and optimizer state: on the device
    (accelerator memory) and on the host (CPU memory, where offload moved them)."""
    params: float
    grads: float
    optim: float
    host_params: float = 0.0
    host_grads: float = 0.0
    host_optim: float = 0.0

    @property
    def device(self) -> float:
        return self.params + self.grads + self.optim

    @property
    def host(self) -> float:
        return self.host_params + self.host_grads + self.host_optim

    @property
    def total(self) -> float:
        return self.device + self.host


def zero_model_states(psi: float, n_d: int = 1, stage: int = 0,
                      bpp: BytesPerParam = MIXED_ADAM, offload=()) -> ModelStates:
    """Model-state bytes per data-parallel rank (Rajbhandari et al. 2020, Section 5).

    psi: parameters; n_d: data-parallel ranks; stage 0 (plain DP), 1 (optimizer states
    partitioned), 2 (+ gradients), 3 (+ parameters); bpp: bytes per parameter (MIXED_ADAM is
    the paper's 2 + 2 + K with K = 12). offload: which of "params", "grads", "optim" live in CPU
    memory instead (ZeRO-Offload moves "optim" and "grads"; ZeRO-Infinity also "params"): the
    same bytes, moved from the device to the host column. Partitions are exact fractions here
    (Ψ/N_d); run_model_state_bytes counts our runs' whole elements."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage} is not one of {sorted(STAGES)}")
    if n_d < 1:
        raise ValueError(f"n_d={n_d} must be >= 1")
    bad = set(offload) - set(OFFLOADABLE)
    if bad:
        raise ValueError(f"offload {sorted(bad)}: choose from {OFFLOADABLE}")
    share = {"params": 1 / n_d if stage >= 3 else 1.0, "grads": 1 / n_d if stage >= 2 else 1.0,
             "optim": 1 / n_d if stage >= 1 else 1.0}
    b = {k: getattr(bpp, k) * psi * share[k] for k in OFFLOADABLE}
    dev = {k: 0.0 if k in offload else v for k, v in b.items()}
    host = {f"host_{k}": v if k in offload else 0.0 for k, v in b.items()}
    return ModelStates(**dev, **host)


def zero_table(psi: float, n_d: int, bpp: BytesPerParam = MIXED_ADAM, offload=()) -> dict:
    """{stage name: device bytes per rank} for stages 0-3: the ZeRO paper's Figure 1 row."""
    return {STAGES[s]: zero_model_states(psi, n_d, s, bpp, offload).device for s in STAGES}


# -- parameter counts ------------------------------------------------------------------------
def transformer_params_approx(n_layer: int, n_embd: int) -> int:
    """12·L·h²: per layer, q, k, v, o (4h²) and an h→4h→h MLP (8h²); no biases, norms or
    embeddings. The papers' shorthand (GPT-3: 12·96·12288² = 173.9B)."""
    return 12 * n_layer * n_embd ** 2


def narayanan_params(n_layer: int, n_embd: int, vocab_size: int, seq_len: int) -> float:
    """Narayanan et al. 2021, Section 5.1: 12Lh²(1 + 13/(12h) + (V + s)/(12Lh)); biases and
    LayerNorms (13h per layer), token and position embeddings, the head tied to the token
    embedding, no final LayerNorm."""
    L, h = n_layer, n_embd
    return 12 * L * h * h * (1 + 13 / (12 * h) + (vocab_size + seq_len) / (12 * L * h))


def gpt_params(n_layer: int, n_embd: int, vocab_size: int, seq_len: int, mlp_ratio: int = 4,
               bias: bool = True, tied_head: bool = False, final_norm: bool = True) -> int:
    """Parameters of a GPT-2-style decoder, term by term (our distlab.models.GPT by default):

        per layer  attention q, k, v, o       4h² (+ 4h biases)
                   MLP h→rh→h                  2rh² (+ rh + h biases)
                   LayerNorm ln1, ln2          4h
        once       token + position embedding  Vh + sh
                   final LayerNorm             2h
                   head (untied)               hV (no bias)

    At r = 4 a layer is 12h² + 13h: the papers' 12Lh² plus Narayanan's 13h."""
    h, r, L = n_embd, mlp_ratio, n_layer
    layer = 4 * h * h + 2 * r * h * h + 4 * h
    if bias:
        layer += 4 * h + r * h + h
    total = L * layer + vocab_size * h + seq_len * h
    if final_norm:
        total += 2 * h
    if not tied_head:
        total += h * vocab_size
    return total


def gpt_params_of(cfg) -> int:
    """gpt_params for a RunConfig or GPTConfig (our model: the module's own count)."""
    seq_len = getattr(cfg, "seq_len", None) or getattr(cfg, "block_size")
    return gpt_params(cfg.n_layer, cfg.n_embd, cfg.vocab_size, seq_len, cfg.mlp_ratio)


def gpt_param_tensors(cfg) -> int:
    """Parameter tensors of our GPT: per layer 2 LayerNorms x 2, 6 Linears x 2 (weight, bias);
    token and position embeddings, ln_f (2), head (1). AdamW keeps a 4-byte `step` per tensor."""
    return cfg.n_layer * (4 + 12) + 2 + 2 + 1


def _gpt_param_numels(cfg) -> list[int]:
    """numel of each parameter tensor, in model.parameters() order."""
    h, r, V = cfg.n_embd, cfg.mlp_ratio, cfg.vocab_size
    s = getattr(cfg, "seq_len", None) or getattr(cfg, "block_size")
    out = [V * h, s * h]
    for _ in range(cfg.n_layer):
        out += [h, h]                                    # ln1
        out += [h * h, h] * 4                            # q, k, v, o
        out += [h, h]                                    # ln2
        out += [r * h * h, r * h, r * h * h, h]          # fc, proj
    return out + [h, h, V * h]                           # ln_f, head


# -- model states of this project's runs ----------------------------------------------------


def _shard(numel: int, n: int) -> int:
    """Elements each rank holds of `numel` split into n equal padded chunks (ceil(numel/n)
    each, the tail padded: DeepSpeed's flat partition). Padding counts: it is allocated."""
    return math.ceil(numel / n)


def _gpt_unit_numels(cfg) -> list[int]:
    """numel of each unit distlab.parallel.zero.stages gathers at a time in our GPT (zero2/zero3):
    "tok_emb+pos_emb", each block "blocks.i", "ln_f+head"."""
    numels = _gpt_param_numels(cfg)
    per_block = (len(numels) - 5) // cfg.n_layer
    blocks = [sum(numels[2 + i * per_block: 2 + (i + 1) * per_block])
              for i in range(cfg.n_layer)]
    return [numels[0] + numels[1]] + blocks + [sum(numels[-3:])]


PARTITIONS = ("flat", "units", "per-param")


def run_model_state_bytes(cfg, rank: int = 0, partition: str | None = None) -> dict:
    """Bytes of parameters, gradients and optimizer state that rank `rank` of a run of `cfg`
    holds after an optimizer step: what the step event's memory reports (fp32 master weights).

    Replicated strategies (single, allreduce, ddp, ddp-torch, diloco): every rank holds all of it:
        params 4Ψ, grads 4Ψ, optim: AdamW 8Ψ + 4 bytes per parameter tensor (its `step`
        counter is a float32 tensor), SGD (no momentum) 0; diloco's outer optimizer adds its
        θ_global and, from the first average on, its momentum buffer: 4Ψ each (under optim).
    ZeRO (zero1/2/3, world N), the paper's partitions over padded flat buffers: a buffer of
    Ψ_u values is padded to P_u = N·ceil(Ψ_u/N) and each rank owns S_u = P_u/N of it:
        stage 1  params 4ΣP_u   grads 4ΣP_u   optim 8ΣS_u + 4 per buffer (AdamW)
        stage 2  params 4ΣP_u   grads 4ΣS_u   optim 8ΣS_u + 4 per buffer
        stage 3  params 4ΣS_u   grads 4ΣS_u   optim 8ΣS_u + 4 per buffer
    The buffers (`partition`) are distlab.parallel.zero.stages's unless named: "flat" (one buffer of
    all Ψ: zero1's), "units" (one per gathered unit: tok_emb+pos_emb, each block, ln_f+head:
    zero2's and zero3's), "per-param" (one per parameter tensor: DeepSpeed ZeRO-3's, FSDP1's).
    With cfg.offload the optimizer bytes are reported under "optim_offloaded" (optim 0), as
    zero.py logs them: on a CPU run they are the same bytes in the same memory.
    Precision (bf16/fp16 autocast) does not change these: the weights stay fp32. `rank` is
    for layouts with uneven shards; with padded buffers every rank holds the same."""
    if cfg.model != "gpt":
        raise ValueError("run_model_state_bytes is derived for the GPT model only")
    psi, n_tensors = gpt_params_of(cfg), gpt_param_tensors(cfg)
    adam = cfg.optimizer == "adamw"

    def optim(numel, buffers):
        return 8 * numel + 4 * buffers if adam else 0

    declared = strategy_class(cfg.strategy)  # what the strategy says it holds (parallel/base.py)
    if declared.replicated:
        # diloco also keeps θ_global (4Ψ) and, with outer momentum, its buffer (4Ψ more)
        outer = (4 * psi * (1 + (cfg.outer_momentum > 0)) if cfg.strategy == "diloco" else 0)
        return {"params": 4 * psi, "grads": 4 * psi, "optim": optim(psi, n_tensors) + outer}
    stage = declared.zero_stage
    if not stage:  # dp, parameter servers, torch's ZeRO-1 (a greedy uneven partition), FSDP
        known = [s for s in strategies()
                 if strategy_class(s).replicated or strategy_class(s).zero_stage]
        raise ValueError(f"strategy {cfg.strategy!r}: no model-state estimate here (written "
                         f"for {', '.join(known)})")
    partition = partition or ("flat" if stage == 1 else "units")
    buffers = {"flat": [psi], "units": _gpt_unit_numels(cfg),
               "per-param": _gpt_param_numels(cfg)}.get(partition)
    if buffers is None:
        raise ValueError(f"partition={partition!r}: one of {PARTITIONS}")
    n = cfg.world_size
    shard = sum(_shard(k, n) for k in buffers)
    padded = n * shard
    out = {"params": 4 * (shard if stage >= 3 else padded),
           "grads": 4 * (shard if stage >= 2 else padded),
           "optim": optim(shard, len(buffers))}
    if cfg.offload:
        out["optim_offloaded"], out["optim"] = out["optim"], 0
    return out


def fp32_adamw_state_bytes(model: torch.nn.Module) -> dict:
    """Bytes of parameters, gradients and AdamW state that one rank of a replicated fp32 run
    (single, ddp) holds after a step, counted on `model`: every value is held (4 bytes, frozen
    ones too), but only trainable values have a gradient (4 bytes) and AdamW's two moments
    (8 bytes), plus AdamW's 4-byte step counter per trainable tensor. With every value
    trainable this is run_model_state_bytes' replicated rule; under LoRA (Hu et al. 2021) the
    gradients and optimizer state shrink to the adapters'."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in trainable)
    return {"params": 4 * sum(p.numel() for p in model.parameters()), "grads": 4 * n,
            "optim": 8 * n + 4 * len(trainable)}


# -- activations: Korthikanti et al. 2022 ------------------------------------------------------
def korthikanti_layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                                       sequence_parallel: bool = False,
                                       recompute: str = "none") -> float:
    """Activation bytes per transformer layer (Korthikanti et al. 2022, Eqs. 1-3, Table 2):
    16-bit activations, 1-byte dropout masks, attention scores materialised (s×s per head).

        recompute="none"       t = 1: sbh(34 + 5as/h)
                               tensor parallel: sbh(10 + 24/t + 5as/(ht))
                               + sequence parallel: sbh/t·(34 + 5as/h)
        recompute="selective"  the attention core is recomputed, dropping the 5as/h term:
                               sbh(10 + 24/t), or 34sbh/t with sequence parallel
        recompute="full"       only the layer input is kept: 2sbh (Table 2)

    Where the 34 comes from (bytes per s·b·h): attention 11 (QKV input 2, Q and K 4, V 2,
    output-projection input 2, dropout mask 1), MLP 19 (input 2, GELU input 8, second linear's
    input 8, dropout mask 1), two LayerNorm inputs 4; the attention core adds 5as²b (softmax
    output 2as²b, its dropout mask as²b, dropout output 2as²b). Tensor parallelism splits all
    but the 10 bytes of LayerNorm and dropout inputs that sit outside the split regions;
    sequence parallelism splits those too."""
    sbh, core = s * b * h, 5 * a * s / h
    if recompute == "full":
        return 2 * sbh
    if recompute == "selective":
        core = 0.0
    elif recompute != "none":
        raise ValueError(f"recompute={recompute!r}: 'none', 'selective' or 'full'")
    if sequence_parallel:
        return sbh / t * (34 + core)
    return sbh * (10 + 24 / t + core / t)


# -- activations of this project's GPT -------------------------------------------------------
def gpt_activation_bytes(cfg, checkpointing: str | None = None, micro_batch: int | None = None,
                         breakdown: bool = False):
    """Bytes our GPT saves for backward in one micro-batch's forward on one rank: what
    ActivationMeter measures in the training loop (fp32).

    Derived by listing what each op of distlab.models.gpt saves (s = seq_len, b = micro-batch
    rows, h = n_embd, r = mlp_ratio, a = n_head, V = vocab_size; 4 bytes per float, 8 per
    int64 index), each storage once:

      per layer, no checkpointing   4·sbh(8 + 2r) + 4·sb(4 + a)
        ln1 input (the block input), ln1 output (read by q, k and v: one storage), q, k, v
        (scaled_dot_product_attention saves its inputs), the attention output (saved by the
        attention and by o: one storage), ln2 input, ln2 output, fc output (GELU's input, r),
        GELU output (proj's input, r) = 8 + 2r values per position; each LayerNorm's mean and
        rstd (2 x 2sb) and the attention's log-sum-exp (a·s·b floats). Weights are parameters,
        not activations.
      per layer, selective          4·sbh(6 + r): block input, q, k, v, o output, fc output,
                                    proj output (distlab.rank.recompute)
      per layer, full               4·sbh: the block input
      once: ln_f input and output 2·4sbh, its mean/rstd 2·4sb, log_softmax output 4sbV, the
        loss's total_weight 4; the token ids 8·R(s+1) (the inputs are a view of the step's
        (R, s+1) int64 batch, R = global_batch rows: data.py slices x and y from one array),
        position ids 8s, targets 8sb (reshape copies the strided view).

    Against Korthikanti et al. (bytes per sbh, 16-bit): their 34 less the two 1-byte dropout
    masks (we have no dropout) is 32 bytes = 16 values, exactly our 8 + 2r at r = 4. Their
    5as/h term (the s×s softmax and dropout) is absent: on CPU scaled_dot_product_attention
    runs a flash kernel that keeps only the log-sum-exp, a·s·b floats, and recomputes the
    scores in backward. Not derived for bf16/fp16: autocast saves low-precision copies of
    inputs and weights beside fp32 tensors; measure those.
    """
    if cfg.model != "gpt":
        raise ValueError("gpt_activation_bytes is derived for the GPT model only")
    # fp8 saves what fp32 saves: its Linears keep their fp32 input and weight for backward
    # and cast them again there (distlab.rank.fp8_linear), the casts living one matmul long
    if cfg.precision not in ("fp32", "fp8"):
        raise NotImplementedError(f"precision={cfg.precision!r}: derived for fp32 only (under "
                                  "autocast some saved tensors are bf16/fp16 copies); measure "
                                  "it with ActivationMeter")
    mode = checkpointing or cfg.checkpointing
    s, h, r, a, V = cfg.seq_len, cfg.n_embd, cfg.mlp_ratio, cfg.n_head, cfg.vocab_size
    b = micro_batch or cfg.micro_batch
    sb, sbh = s * b, s * b * h
    if mode == "none":
        layer = 4 * sbh * (8 + 2 * r) + 4 * sb * (4 + a)
    elif mode == "selective":
        layer = 4 * sbh * (6 + r)
    elif mode == "full":
        layer = 4 * sbh
    else:
        raise ValueError(f"checkpointing={mode!r}: 'none', 'selective' or 'full'")
    head = 2 * 4 * sbh + 2 * 4 * sb + 4 * sb * V + 4
    ids = 8 * cfg.global_batch * (s + 1) + 8 * s + 8 * sb
    parts = {"layers": cfg.n_layer * layer, "per_layer": layer, "head": head, "ids": ids}
    total = parts["layers"] + head + ids
    return (total, parts) if breakdown else total


def estimate_run(cfg, rank: int = 0, partition: str | None = None) -> dict:
    """The textbook column of a notebook's table: params, grads, optim and activations (bytes)
    for rank `rank` of a run of `cfg` (fp32; activations for our GPT)."""
    out = dict(run_model_state_bytes(cfg, rank, partition))
    try:
        out["activations"] = gpt_activation_bytes(cfg)
    except NotImplementedError:
        out["activations"] = None
    return out


# -- torch's twins and autocast: what the workbook sets beside them ------------------------------
STAGE_OF = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero1-torch": 1, "fsdp-torch": 3}


def fsdp2_model_state_bytes(cfg: RunConfig, rank: int = 0) -> dict:
    """Model-state bytes rank `rank` of an `fsdp-torch` run of cfg's GPT holds: what
    distlab.parallel.zero.zero_torch logs from the DTensors' local shards.

    FSDP2 shards every parameter on dim 0 as torch.chunk does: chunks of ceil(rows/N) rows,
    rank r gets chunk r (an empty one past the last row), unpadded. fp32, 4 bytes a value.
    AdamW keeps exp_avg and exp_avg_sq of the local shard (8 bytes a value) and a 4-byte `step`
    counter for every parameter tensor on every rank (each rank steps every tensor's shard).
    cfg.offload (CPUOffloadPolicy): the same bytes, all three under "*_offloaded".
    HSDP (cfg.shard_ranks = g): N = g, and the rank holds chunk r mod g (its group's ranks are
    consecutive: init_device_mesh's (replicate, shard) layout)."""
    n = cfg.shard_ranks or cfg.world_size
    rank %= n
    with torch.device("meta"):
        params = list(GPT(GPTConfig.from_run(cfg)).parameters())
    local = 0
    for p in params:
        rows = p.shape[0]
        c = math.ceil(rows / n)
        local += max(0, min(c, rows - rank * c)) * (p.numel() // rows)
    optim = 8 * local + 4 * len(params) if cfg.optimizer == "adamw" else 0
    out = {"params": 4 * local, "grads": 4 * local, "optim": optim}
    if cfg.offload:
        return {**{k: 0 for k in out}, **{f"{k}_offloaded": v for k, v in out.items()}}
    return out


def estimate_memory(cfg: RunConfig, rank: int = 0) -> tuple[dict, str]:
    """(bytes by category, where the numbers come from) for rank `rank` of a run of cfg:
    model states and activations; comm buffers are not estimated (None).

    replicated strategies (single, allreduce, ddp, ddp-torch) and zero1/2/3: estimate_run,
    derived for our padded flat buffers.
    fsdp-torch: fsdp2_model_state_bytes (dim-0 shards); activations as our GPT's
    (gpt_activation_bytes). zero1-torch (greedy whole-tensor partition): the ZeRO paper's
    stage-1 formula with fp32 AdamW's bytes, Ψ/N exactly."""
    declared = strategy_class(cfg.strategy)
    if declared.replicated or declared.zero_stage:
        est = {k: v for k, v in estimate_run(cfg, rank).items() if v is not None}
        src = "distlab.theory.estimate.estimate_run (exact for our code)"
    elif cfg.strategy == "fsdp-torch":
        est = {**fsdp2_model_state_bytes(cfg, rank), "activations": gpt_activation_bytes(cfg)}
        src = "fsdp2_model_state_bytes (FSDP2's dim-0 shards) + our GPT's activations"
    else:
        bpp = FP32_ADAM if cfg.optimizer == "adamw" else FP32_SGD
        st = zero_model_states(gpt_params_of(cfg), cfg.world_size, STAGE_OF[cfg.strategy], bpp)
        est = {"params": st.params, "grads": st.grads, "optim": st.optim,
               "activations": gpt_activation_bytes(cfg)}
        src = "ZeRO paper's formula with fp32 AdamW (4, 4, K = 8 bytes per parameter)"
    est["comm_buffers"] = None
    return est, src


def autocast_weight_copy_bytes(cfg: RunConfig) -> int:
    """Bytes of the low-precision weight copies autocast makes in our GPT's forward, by
    formula: every nn.Linear's weight (q, k, v, o: 4h² per layer; fc, proj: 2rh²; the head hV)
    cast to 2 bytes, except in modules kept fp32 (cfg.fp32_modules). Biases are copied too but
    not saved for backward (addmm's gradient for the bias needs none). 0 in fp32, and in fp8
    (no autocast: its Linears' casts are not saved, distlab.rank.fp8_linear)."""
    if cfg.precision in ("fp32", "fp8"):
        return 0
    h, r, V, L = cfg.n_embd, cfg.mlp_ratio, cfg.vocab_size, cfg.n_layer
    fp32 = {n.strip() for n in cfg.fp32_modules.split(",") if n.strip()}
    per_layer = {"attn": 4 * h * h, "mlp": 2 * r * h * h}
    total = 0
    for i in range(L):
        for part, n in per_layer.items():
            if not ({f"blocks.{i}", f"blocks.{i}.{part}"} & fp32):
                total += n
    if "head" not in fp32:
        total += h * V
    return 2 * total
