"""fp32_adamw_state_bytes (distlab.theory.estimate) counts what a rank holds after an AdamW step:
workbook/08_lora_finetuning asserts it against the ranks' memory events; here it is set beside
distlab.memory.model_state_bytes in one process, for full fine-tuning and for LoRA, byte for byte
(counts of the same tensors: no tolerance).
"""

import pytest
import torch

from distlab import RunConfig
from distlab.data.dataset import make_data
from distlab.memory import model_state_bytes
from distlab.rank.build import build_model, build_optimizer
from distlab.theory.estimate import fp32_adamw_state_bytes, run_model_state_bytes

SMALL = RunConfig(global_batch=8, seq_len=16, n_layer=2, n_embd=32, n_head=2, optimizer="adamw")


@pytest.mark.parametrize("lora", [dict(), dict(lora_rank=4, lora_targets="qv"),
                                  dict(lora_rank=2, lora_targets="attn_mlp")])
def test_formula_equals_measured_after_an_adamw_step(lora):
    cfg = SMALL.replace(**lora)
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = build_optimizer(cfg, [p for p in model.parameters() if p.requires_grad])
    x, y = make_data(cfg).rank_batch(0, cfg.global_batch, 0, 1)
    model(x, y).backward()
    opt.step()  # AdamW makes its state here, for the trainable values only
    assert fp32_adamw_state_bytes(model) == model_state_bytes(model, opt)


def test_all_trainable_is_the_replicated_rule():
    assert fp32_adamw_state_bytes(build_model(SMALL)) == run_model_state_bytes(SMALL)
