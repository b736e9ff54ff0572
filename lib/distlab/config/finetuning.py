"""RunConfig's fine-tuning section: a new task from a trained model (distlab.finetune.lora,
distlab.finetune.forgetting)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from distlab.config.declare import Feature, declare

# LoRA's target presets: regexes on module names (distlab.finetune.lora); any other value is a regex
LORA_TARGETS = {
    "qv": r"attn\.(q|v)$",
    "attn": r"attn\.(q|k|v|o)$",
    "attn_mlp": r"(attn\.(q|k|v|o)|mlp\.(fc|proj))$",
}


@dataclass
class Finetuning:
    """Which task the data is, the weights a run starts from and where it writes its own,
    LoRA adapters, and what keeps the old task: replay, EWC, held-out evaluation."""

    task: int = declare(0, "which Markov chain: 0 the default; k >= 1 redraws half its rows",
                        at_least=0)
    # A resumed run may evaluate as often as it likes and write its model anywhere
    init_from: str = declare("", "a model state-dict .pt to start from (loaded before LoRA, "
                             "wrapping)")
    save_final: str = declare("", "write the trained model's state dict here (adapters merged)",
                              may_change=True)
    lora_rank: int = declare(0, "0: full fine-tuning; r >= 1: LoRA adapters of rank r, the "
                             "rest frozen", at_least=0,
                             feature=Feature("lora", "lora_rank > 0 (LoRA adapters)"))
    lora_alpha: float = declare(8.0, "adapters' output scaled by lora_alpha / lora_rank")
    lora_targets: str = declare("qv", "qv | attn | attn_mlp, or a regex on module names")
    replay: float = declare(0.0, "fraction of each batch's rows drawn from task 0 (replay "
                            "buffer)")
    ewc_lambda: float = declare(
        0.0, "Elastic Weight Consolidation strength (anchor: the start weights)",
        feature=Feature("ewc", "ewc_lambda > 0 (every rank adds the EWC penalty's gradient to "
                        "whole gradients)"))
    eval_every: int = declare(0, "'eval' event: held-out loss on tasks 0 and `task` every k "
                              "steps", at_least=0, may_change=True,
                              feature=Feature("eval", "eval_every > 0 (every rank evaluates the "
                                              "whole model)"))

    def check(self) -> None:
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
