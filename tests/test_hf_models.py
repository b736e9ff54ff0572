"""Hugging Face's GPT-2 (Conv1D layers, lm_head tied to wte) and Llama (rotary embeddings,
grouped KV heads), built from small configs with random weights, nothing downloaded, under
distlab's public API on 2 ranks, against one process on the same global batch, with the HF
Trainer's clipping line: DistributedDataParallel, ZeroOptimizer stages 1 and 2, fully_shard
(with ZeroOptimizer, and with torch.optim.SGD built after it as FSDP2 users do), and
parallelize_module with the model's own plan (Llama's config.base_model_tp_plan; GPT-2's
Conv1D MLP layers). Optional: skipped where transformers is not installed (distlab does
not depend on it; `pip install transformers` runs it).

One launch of 2 ranks per model trains every way in turn, each from a freshly built model
(building an HF model imports most of transformers, seconds per process on the 2-core CI
machine: one launch per way cost 12 launches).

Tolerance ATOL = 1e-5 as in tests/test_real_shapes.py: fp32, SGD lr 0.1, 3 steps; only the
summation order differs (two 4-row means against one 8-row mean, equal token counts).
"""

import pytest
import torch

from distlab import DistributedDataParallel, ZeroOptimizer, fully_shard, run_ranks

transformers = pytest.importorskip("transformers")

ATOL, LR, ROWS, T, VOCAB = 1e-5, 0.1, 8, 16, 64
WAYS = ("ddp", "zero1", "zero2", "fully_shard", "fully_shard, torch.optim.SGD",
        "tensor parallel")


def build(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def train(model, opt, rank, world):
    for step in range(3):
        x = torch.randint(0, VOCAB, (ROWS, T), generator=torch.Generator().manual_seed(step))
        x = x[rank * ROWS // world:(rank + 1) * ROWS // world]
        model(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the HF Trainer's line
        opt.step()
        opt.zero_grad()


def sharded(kind, how, rank, world):
    model = build(kind)
    if how == "ddp":
        model = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    elif how == "fully_shard":
        fully_shard(model)
        opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=LR)
    elif how == "fully_shard, torch.optim.SGD":  # FSDP2's habit: a plain optimizer after it
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=int(how[-1]), lr=LR)
    train(model, opt, rank, world)
    inner = model.module if how == "ddp" else model
    return {k: v.clone() for k, v in inner.state_dict().items()}


def tensor_parallel(kind, world):
    """The model's own plan (Llama: config.base_model_tp_plan, strings relative to the base
    model) or GPT-2's Conv1D layers, its fused q|k|v c_attn split part by part (GPT-2 then
    splits the output by attn.split_size, set to this rank's width); every rank feeds the
    whole batch under TP. The base model's full state (the lm_head is not split)."""
    from distlab import ColwiseParallel, parallelize_module
    from distlab.parallel.tensor.tp import full_state_dict
    model = build(kind)
    gpt2_plan = {"h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise",
                 "h.*.attn.c_attn": ColwiseParallel(parts=3), "h.*.attn.c_proj": "rowwise"}
    base, plan = ((model.transformer, gpt2_plan) if kind == "gpt2"
                  else (model.model, model.config.base_model_tp_plan))
    parallelize_module(base, plan)
    if kind == "gpt2":
        for block in base.h:
            block.attn.split_size //= world
    train(model, torch.optim.SGD(model.parameters(), lr=LR), 0, 1)
    return {k: v.clone() for k, v in full_state_dict(base).items()}


def every_way(rank, world, device, log, kind):
    return {how: tensor_parallel(kind, world) if how == "tensor parallel"
            else sharded(kind, how, rank, world) for how in WAYS}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_models_train_every_way_as_one_process(kind):
    model = build(kind)
    train(model, torch.optim.SGD(model.parameters(), lr=LR), 0, 1)
    ref = model.state_dict()
    base = model.transformer if kind == "gpt2" else model.model
    ref_base = base.state_dict()
    for r, states in enumerate(run_ranks(every_way, 2, kind, timeout_s=120)):
        assert list(states) == list(WAYS)
        for how, state in states.items():
            want = ref_base if how == "tensor parallel" else ref
            if how == "tensor parallel":  # TP's gathered names are the base model's own
                assert state.keys() == want.keys(), (kind, r)
            worst = max((state[k] - want[k]).abs().max().item() for k in want)
            assert worst <= ATOL, (kind, how, r, worst)
