"""Where ranks run and which backend they use (distlab.caller.launch.place_rank), decided for any
number of GPUs without one: the rule the GPU tests (tests/gpu) then check on a real GPU. And
distlab.studies.gpu's arithmetic (model FLOPs, datasheet peaks), which needs no GPU either."""

import pytest
import torch

from distlab import RunConfig
from distlab.studies import gpu as G
from distlab.theory import flops as F
from distlab.caller.launch import place_rank, start_ranks
from distlab.rank.build import build_model


@pytest.mark.parametrize("device,backend,world,gpus,rank,expected", [
    ("cpu", "auto", 4, 0, 3, ("cpu", "gloo")),
    ("cpu", "gloo", 2, 8, 1, ("cpu", "gloo")),
    ("auto", "auto", 2, 0, 1, ("cpu", "gloo")),
    ("auto", "auto", 2, 1, 1, ("cpu", "gloo")),  # auto: CUDA only with one GPU per rank
    ("auto", "auto", 2, 2, 1, ("cuda:1", "nccl")),
    ("auto", "gloo", 2, 4, 1, ("cuda:1", "gloo")),
    ("cuda", "auto", 1, 1, 0, ("cuda:0", "nccl")),
    ("cuda", "nccl", 4, 4, 3, ("cuda:3", "nccl")),
    ("cuda", "gloo", 2, 1, 1, ("cuda:0", "gloo")),  # asked for: two ranks share GPU 0
    ("cuda", "gloo", 4, 2, 3, ("cuda:1", "gloo")),  # round robin
])
def test_place_rank(device, backend, world, gpus, rank, expected):
    assert place_rank(device, backend, rank, world, gpus) == expected


@pytest.mark.parametrize("device,backend,world,gpus,says", [
    ("cpu", "nccl", 1, 1, "device='cpu'"),
    ("auto", "nccl", 1, 0, "found 0 GPU(s) for 1 rank(s)"),
    ("auto", "nccl", 2, 1, "found 1 GPU(s) for 2 rank(s)"),
    ("cuda", "auto", 1, 0, "torch sees no CUDA GPU"),
    ("cuda", "gloo", 2, 0, "torch sees no CUDA GPU"),
    ("cuda", "nccl", 2, 1, "NCCL needs one GPU per rank"),
    ("cuda", "auto", 2, 1, "Set backend='gloo'"),
    ("tpu", "auto", 1, 0, "device='tpu'"),
])
def test_place_rank_refuses_what_cannot_work(device, backend, world, gpus, says):
    with pytest.raises(ValueError) as e:
        place_rank(device, backend, 0, world, gpus)
    assert says in str(e.value)


def test_start_ranks_refuses_before_any_rank_starts(tmp_path):
    """The caller gets the error, and no process or run folder is made."""
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        start_ranks(G.time_training, 2, (), str(tmp_path / "never"), device="cuda")
    assert not (tmp_path / "never").exists()
    with pytest.raises(ValueError, match="backend='nccl' needs device='cuda'"):
        RunConfig(backend="nccl", device="cpu")


def test_flops_per_token_counts_the_multiplying_parameters():
    cfg = RunConfig(n_layer=3, n_embd=64, n_head=4, seq_len=32, vocab_size=100, mlp_ratio=4)
    model = build_model(cfg)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert F.matmul_params(cfg) == weights
    assert F.train_flops_per_token(cfg) == 6 * weights + 12 * 3 * 64 * 32


def test_datasheet_peaks():
    assert F.datasheet_peak("NVIDIA H100 80GB HBM3", "bf16")[0] == 989e12
    assert F.datasheet_peak("NVIDIA H100 PCIe", "bf16")[0] == 756e12
    assert F.datasheet_peak("NVIDIA H100 NVL", "fp32")[0] == 60e12
    assert F.datasheet_peak("NVIDIA H200", "bf16")[0] == 989e12
    # fp8: the sheets' figures with sparsity, halved
    assert F.datasheet_peak("NVIDIA H100 80GB HBM3", "fp8")[0] == 3958e12 / 2
    assert F.datasheet_peak("NVIDIA H100 PCIe", "fp8")[0] == 3026e12 / 2
    assert F.datasheet_peak("NVIDIA H200 NVL", "fp8")[0] == 3341e12 / 2
    assert F.datasheet_peak("NVIDIA A10G", "bf16") is None
    assert F.datasheet_peak("NVIDIA H100 80GB HBM3", "fp16") is None
    assert G.mfu({"precision": "bf16", "flops_per_s": 1.0}, "cpu") == \
        (None, "n/a (no datasheet peak for this CPU)")


def test_pick_gpt_fills_the_fraction_asked():
    cfg = G.pick_gpt(80 * 2**30)
    assert G.gpt_bytes_fp32(cfg) <= 0.55 * 80 * 2**30
    assert G.gpt_bytes_fp32(cfg.replace(global_batch=2 * cfg.global_batch)) > 0.55 * 80 * 2**30
    assert G.pick_gpt(2**20) is None
