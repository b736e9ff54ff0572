"""RunConfig's model section: the network trained (distlab.models), its size, its experts."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.config.declare import Feature, declare
from distlab.models import factory
from distlab.parallel import strategies, strategy_class

MODELS = ("gpt", "bnnet")
# written for distlab's GPT and its data: refused with a model of your own
_GPT_ONLY = ("checkpointing", "lora_rank", "init_from", "task", "eval_every", "dataset_size", "sp")


@dataclass
class Model:
    """The network: distlab's tiny GPT, a small BatchNorm net, or yours by import path; its
    size; a mixture of experts in each block (distlab.models.moe)."""

    model: str = declare("gpt", "gpt (distlab.models.gpt), bnnet (distlab.models.bnnet), or "
                         "yours: 'package.module:function' or 'file.py:function'")
    n_layer: int = declare(4, "transformer blocks", at_least=1, at_most=10_000)
    n_embd: int = declare(128, "width of the residual stream", at_least=1, at_most=1 << 20)
    n_head: int = declare(4, "attention heads per block", at_least=1)
    mlp_ratio: int = declare(4, "the MLP's hidden width over n_embd", at_least=1)
    vocab_size: int = declare(64, "tokens in the vocabulary", at_least=2, at_most=1 << 24)
    hidden_layers: int = declare(2, "bnnet: hidden Linear+BatchNorm layers (width n_embd)",
                                 at_least=1)
    n_experts: int = declare(0, "experts in each block's mixture of experts instead of the "
                             "MLP (0: dense)", at_most=1024,
                             feature=Feature("moe", "n_experts > 0 (a mixture of experts)"))
    top_k: int = declare(1, "experts per token: 1 is Switch Transformer's routing, 2 GShard's, "
                         "more with many small experts (DeepSeekMoE)", at_least=1)
    capacity_factor: float = declare(1.25, "each expert's capacity over an even share of the "
                                     "tokens; tokens beyond it are dropped (0: dropless, no "
                                     "capacity)", at_least=0)
    aux_loss_coef: float = declare(0.01, "Switch's load-balancing loss, added to the loss")
    moe_groups: int = declare(0, "GShard's groups over the global batch (capacity and balance "
                              "loss per group; 0: one per data-parallel rank's rows)")
    n_shared_experts: int = declare(0, "DeepSeekMoE's shared experts: every token passes "
                                    "through them besides its top_k", at_least=0, at_most=64)
    expert_hidden: int = declare(0, "each expert's hidden width (0: mlp_ratio x n_embd); "
                                 "narrower for DeepSeekMoE's fine-grained experts", at_least=0)
    expert_bias_rate: float = declare(0.0, "auxiliary-loss-free balance (DeepSeek-V3): each "
                                      "expert's routing bias moves this much per step against "
                                      "its load (1e-3 in its report; 0: off)", at_least=0)
    expert_grouped: str = declare("loop", "the experts on their uneven batches: one after "
                                  "another (loop) or one grouped product (grouped_mm)",
                                  choices=("loop", "grouped_mm"))

    @property
    def moe_groups_per_rank(self) -> int:
        """GShard's groups in one rank's forward."""
        return (self.moe_groups or self.dp_degree) // self.dp_degree

    def check(self) -> None:
        _check_model(self)
        if self.sync_bn and self.model == "gpt":
            raise ValueError("sync_bn=True: distlab's GPT has no BatchNorm (model='bnnet' or a "
                             "model of your own does)")
        _check_experts(self)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")


def _check_model(cfg) -> None:
    """A built-in model, or a model and data factory named by import path (their import and a
    first forward are checked by launch(), distlab.models.factory.check)."""
    if not factory.is_spec(cfg.model):
        if cfg.model not in MODELS:
            raise ValueError(f"model={cfg.model!r} is not one of: "
                             f"{', '.join(map(repr, MODELS))}, nor 'package.module:function' "
                             "(a model of your own, distlab.models.factory)")
        if cfg.data:
            raise ValueError(f"data={cfg.data!r} feeds a model of your own; model="
                             f"{cfg.model!r} brings its data (set data='')")
        return
    factory.parse("model", cfg.model)
    if not cfg.data:
        raise ValueError(f"model={cfg.model!r} needs its data: set data='package.module:"
                         "function' (a function returning an object with "
                         "global_batch(step, batch) -> (x, y))")
    factory.parse("data", cfg.data)
    if not strategy_class(cfg.strategy).any_model:
        mine = [s for s in strategies() if strategy_class(s).any_model]
        raise ValueError(f"strategy={cfg.strategy!r} splits distlab's GPT by its layer "
                         f"names; a model of your own runs under: {', '.join(mine)}")
    gpt_only = [n for n in _GPT_ONLY if getattr(cfg, n) not in (0, "", "none", False)]
    if gpt_only:
        raise ValueError(f"{', '.join(gpt_only)}: written for distlab's GPT and its data, "
                         f"not model={cfg.model!r} (sp: your tp_plan says where the "
                         "sequence is split)")


def _check_experts(cfg) -> None:
    if not cfg.n_experts:
        if cfg.strategy == "ep":
            raise ValueError("strategy='ep' places the experts of a mixture of experts on "
                             "the ranks: set n_experts (e.g. 4)")
        return
    if cfg.model != "gpt":
        raise ValueError(f"n_experts={cfg.n_experts} gives distlab's GPT mixture-of-experts "
                         f"blocks, not model={cfg.model!r}")
    if "moe" not in strategy_class(cfg.strategy).supports:
        raise ValueError(f"n_experts={cfg.n_experts}: a mixture of experts runs under "
                         f"{', '.join(strategies(supporting='moe'))} (the others split the "
                         f"blocks' MLP by its layer names), not strategy={cfg.strategy!r}")
    if cfg.n_experts < 2 or cfg.top_k > cfg.n_experts:
        raise ValueError(f"n_experts={cfg.n_experts}, top_k={cfg.top_k}: top_k is at most "
                         "n_experts (2 or more)")
    from distlab.models.moe import grouped_unavailable
    if (why := grouped_unavailable(cfg.expert_grouped)) is not None:
        raise ValueError(f"expert_{why}")
    if cfg.precision == "fp8" and cfg.expert_grouped != "loop":
        raise ValueError("precision='fp8' casts each Linear's operands; "
                         f"expert_grouped={cfg.expert_grouped!r} multiplies the experts' "
                         "weights without their Linears: use expert_grouped='loop'")
    if cfg.lora_rank:
        raise ValueError("lora_rank with n_experts: the adapters target the dense MLP's "
                         "layers; use a dense model (n_experts=0)")
    groups = cfg.moe_groups or cfg.dp_degree
    if groups < 0 or groups % cfg.dp_degree or (cfg.micro_batch * cfg.seq_len) % (
            groups // cfg.dp_degree):
        raise ValueError(f"moe_groups={cfg.moe_groups} must be a multiple of the "
                         f"{cfg.dp_degree} data-parallel ranks and split each rank's "
                         f"{cfg.micro_batch * cfg.seq_len} tokens per forward evenly")
