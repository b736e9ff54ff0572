import math

import numpy as np
import torch

from distlab.data.dataset import MarkovData
from distlab.models import GPT, GPTConfig, gpt_param_count


def test_param_count_formula_matches_the_module():
    for c in (GPTConfig(), GPTConfig(n_layer=2, n_embd=32, n_head=2, mlp_ratio=2, vocab_size=50)):
        assert GPT(c).num_params() == gpt_param_count(c)
    # the default model is the "about 1M parameters" of the workbook
    assert 0.7e6 < GPT(GPTConfig()).num_params() < 1.3e6


def test_blocks_are_addressable_by_name():
    m = GPT(GPTConfig(n_layer=2))
    for name in ("blocks.0.attn.q", "blocks.1.mlp.fc", "blocks.1.mlp.proj", "head", "tok_emb"):
        assert isinstance(m.get_submodule(name), torch.nn.Module)


def test_data_is_deterministic_and_rank_slices_partition_the_global_batch():
    d = MarkovData(seq_len=16, seed=3)
    x, y = d.global_batch(step=5, batch=8)
    x2, y2 = MarkovData(seq_len=16, seed=3).global_batch(step=5, batch=8)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    for world in (2, 4):
        parts = [d.rank_batch(5, 8, r, world) for r in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert not torch.equal(d.global_batch(6, 8)[0], x)  # each step draws new data


def test_every_transition_follows_the_chain_and_the_floor_is_its_entropy():
    d = MarkovData(vocab_size=16, seq_len=32, successors=2, seed=1)
    x, y = d.global_batch(0, 64)
    allowed = {(a, b) for a in range(16) for b in d.succ[a]}
    assert all((a, b) in allowed for a, b in zip(x.flatten().tolist(), y.flatten().tolist()))
    # the floor lies between 0 and the entropy of the widest row, far below ln V
    rows = -(d.probs * np.log(d.probs)).sum(1)
    assert rows.min() - 1e-9 <= d.loss_floor <= rows.max() + 1e-9
    assert d.loss_at_start == math.log(16)


def test_untrained_model_starts_near_ln_vocab():
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    x, y = MarkovData(seq_len=16).global_batch(0, 8)
    # weights start at std 0.02, so the logits are nearly flat: the loss is ln V within 0.05
    assert abs(m(x, y).item() - math.log(64)) < 0.05
