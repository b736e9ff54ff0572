"""LoRA (distlab.finetune.lora): the adapter's algebra in one process, then LoRA fine-tuning under `ddp`,
`zero1/2/3` and torch's DDP (`ddp-torch`) against `single`, with the bytes they move.

Launches: one `single` launch pre-trains task 0 (save_final writes its weights) and trains the
LoRA references from them; one launch at world 2 trains the same LoRA configs under each
strategy. The forgetting checks (replay, EWC) are in test_forgetting.py.

Equivalence tolerance: atol=1e-5 on every parameter (frozen and adapter) after 20 SGD steps in
float32, as test_ddp.py / test_zero.py. LoRA changes what is trained, not how the update is
reduced: the adapters' gradients are all-reduced (or reduce-scattered) exactly as full
gradients are, so only the summation order differs from `single` (~1e-7 relative per step,
which SGD does not amplify); 1e-5 leaves a >100x margin while a frozen weight that moved, or an
adapter gradient not averaged, moves values by ~1e-3 or more. Frozen weights must match
*exactly*: nothing may touch them.
"""

import hashlib
import math

import pytest
import torch

from distlab import RunConfig, run_ranks
from distlab.comm import ring_allreduce_bytes
from distlab.data.dataset import MarkovData
from distlab.events import step_events_per_run
from distlab.config import LORA_TARGETS as TARGETS
from distlab.finetune.lora import (LoRALinear, inject_lora, lora_layer_count,
                          lora_parameter_count, merge_lora, merged_state_dict, target_shapes,
                          trainable_parameters, unmerge_lora)
from distlab.models import GPT, GPTConfig
from distlab.parallel.zero.stages import padded_size
from distlab.caller.run import Run
from distlab.rank.train import train_with_state
from distlab.rank.build import build_model

ATOL = 1e-5
GPT_KW = dict(n_layer=2, n_embd=32, n_head=2, seq_len=16, global_batch=16, timeout_s=60)
STRATEGIES = ("ddp", "ddp-torch", "zero1", "zero2", "zero3")
RANK, TARGET = 4, "attn_mlp"  # every block gets adapters in attention and MLP


def _gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_embd=32, n_head=2, **kw))


def _tokens():
    return MarkovData(64, 16, 3, 0).global_batch(0, 4)


# -- the adapter, in one process -----------------------------------------------------------------
@pytest.mark.parametrize("targets", list(TARGETS))
def test_b_zero_start_equals_the_base_model_exactly(targets):
    model = _gpt()
    x, _ = _tokens()
    before = model(x)
    inject_lora(model, targets, rank=4, alpha=8.0)
    # B = 0 makes the adapter path add exact zeros: bitwise equal, no tolerance needed
    assert torch.equal(model(x), before)


def _random_b(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)


def test_merged_equals_unmerged_and_unmerge_restores_the_weight():
    model = _gpt()
    inject_lora(model, "attn_mlp", rank=4, alpha=8.0)
    _random_b(model)  # a trained-looking adapter: B != 0
    x, _ = _tokens()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("weight")}
    unmerged = model(x)
    assert merge_lora(model) == 2 * 6  # 2 blocks x (q, k, v, o, fc, proj)
    merged = model(x)
    # (W + sBA)x vs Wx + s·B(Ax): the same sums associated differently. float32 rounding of
    # logits of magnitude ~0.5 through 2 blocks: observed 1.2e-7 here (2.9e-6 on notebook 08's
    # trained 64-wide model); 1e-5 stays above both, while a wrong scale (α instead of α/r) or
    # a transposed BA changes logits by >1e-2.
    assert (merged - unmerged).abs().max().item() < 1e-5
    d = {n: m.delta_weight() for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert max(v.abs().max().item() for v in d.values()) > 1e-3  # the merge did change W
    unmerge_lora(model)
    eps = torch.finfo(torch.float32).eps
    for n, p in model.named_parameters():
        if n in w0:
            # (W + Δ) - Δ: two roundings, each at most half an ulp of |W + Δ|
            bound = eps * (w0[n].abs().max() + d.get(n.removesuffix(".weight"),
                                                     torch.zeros(1)).abs().max()).item()
            assert (p - w0[n]).abs().max().item() <= bound, n
    assert torch.allclose(model(x), unmerged, atol=1e-6, rtol=0)


def test_merged_state_dict_loads_into_a_plain_model_and_gives_the_same_outputs():
    model = _gpt()
    inject_lora(model, "qv", rank=2, alpha=4.0)
    _random_b(model)
    x, _ = _tokens()
    plain = _gpt()
    plain.load_state_dict(merged_state_dict(model))  # strict: no lora_A/lora_B keys left
    assert (plain(x) - model(x)).abs().max().item() < 1e-5  # as above: merged vs unmerged


def test_only_adapters_are_trainable_and_receive_gradients():
    model = _gpt()
    names = inject_lora(model, "qv", rank=4, alpha=8.0)
    assert names == [f"blocks.{i}.attn.{p}" for i in range(2) for p in ("q", "v")]
    x, y = _tokens()
    model(x, y).backward()
    for n, p in model.named_parameters():
        is_adapter = n.endswith(("lora_A", "lora_B"))
        assert p.requires_grad == is_adapter, n  # embeddings, LayerNorms, head, W, b frozen
        assert (p.grad is not None) == is_adapter, n
        if n.endswith("lora_B"):  # B's gradient (A x)ᵀ-weighted is nonzero at B = 0 ...
            assert p.grad.abs().max() > 0
        if n.endswith("lora_A"):  # ... A's is exactly zero there: it flows through B = 0
            assert torch.count_nonzero(p.grad) == 0


@pytest.mark.parametrize("rank", [1, 4, 16])
def test_trainable_count_matches_the_formula(rank):
    d, h, L = 32, 4 * 32, 2
    by_hand = {"qv": L * 2 * rank * (d + d),
               "attn": L * 4 * rank * (d + d),
               "attn_mlp": L * (4 * rank * (d + d) + rank * (d + h) + rank * (h + d))}
    for targets, expected in by_hand.items():
        model = _gpt()
        shapes = target_shapes(model, targets)
        inject_lora(model, targets, rank, alpha=8.0)
        assert trainable_parameters(model) == lora_parameter_count(shapes, rank) == expected


def test_the_interview_example_rank_8_on_4096_by_4096():
    assert lora_layer_count(4096, 4096, 8) == 65_536
    assert 4096 * 4096 == 16_777_216
    layer = LoRALinear(torch.nn.Linear(4096, 4096, bias=False), rank=8, alpha=16)
    assert trainable_parameters(layer) == 65_536  # measured on the module
    assert 16_777_216 / 65_536 == 256


def test_targets_that_match_nothing_are_refused_with_the_module_names():
    with pytest.raises(ValueError, match="blocks.0.attn.q"):
        inject_lora(_gpt(), r"nothing\.here$", rank=2, alpha=4.0)


# -- data: task 0 unchanged, task 1 half redrawn -------------------------------------------------
def _digest(x, y):
    return hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()


def test_task_0_data_is_exactly_what_it_was_before_tasks_existed():
    # Digests of MarkovData's output before the `task` field was added (recorded then): every
    # other test's data depends on it.
    d = MarkovData(64, 16, 3, 0)
    assert _digest(*d.global_batch(5, 8)) == \
        "1eedfd564a97b793e502de51b072087793aec1addc27cfc248e06228ca4d130f"
    assert d.loss_floor == pytest.approx(0.8611040784099839, abs=1e-15)
    d = MarkovData()
    assert _digest(*d.global_batch(0, 16)) == \
        "81823d768feed1d813097bb7940f6b0ed6d6fcea4013dcaa6d765fee53214788"
    assert hashlib.sha256(d.succ.tobytes() + d.probs.tobytes()).hexdigest() == \
        "9f654476517d3d367c565ee95130fda832eccc23056d862aad14b5ae8158e2b7"
    assert RunConfig().task == 0


def test_task_1_redraws_half_the_rows_and_has_its_own_streams():
    t0, t1 = MarkovData(64, 16, 3, 0), MarkovData(64, 16, 3, 0, task=1)
    changed = (t0.succ != t1.succ).any(1) | (t0.probs != t1.probs).any(1)
    assert changed.sum() == 32 and set(changed.nonzero()[0]) == set(t1.shifted)
    assert not torch.equal(t0.global_batch(0, 8)[0], t1.global_batch(0, 8)[0])
    assert not torch.equal(t0.eval_batch(0, 8)[0], t0.global_batch(0, 8)[0])


# -- init_from errors --------------------------------------------------------------------------
def test_init_from_errors_name_the_problem(tmp_path):
    cfg = RunConfig(**GPT_KW)
    with pytest.raises(FileNotFoundError, match="no such file"):
        build_model(cfg.replace(init_from=str(tmp_path / "absent.pt")))
    wide = tmp_path / "wide.pt"
    torch.save(build_model(cfg.replace(n_embd=64)).state_dict(), wide)
    with pytest.raises(ValueError, match=r"shape mismatch: tok_emb.weight \(file \(64, 64\), "
                                         r"model \(64, 32\)\)"):
        build_model(cfg.replace(init_from=str(wide)))
    deep = tmp_path / "deep.pt"
    torch.save(build_model(cfg.replace(n_layer=3)).state_dict(), deep)
    with pytest.raises(ValueError, match=r"unexpected: blocks.2.ln1.weight"):
        build_model(cfg.replace(init_from=str(deep)))
    shallow = tmp_path / "shallow.pt"
    torch.save(build_model(cfg.replace(n_layer=1)).state_dict(), shallow)
    with pytest.raises(ValueError, match=r"missing: blocks.1.ln1.weight"):
        build_model(cfg.replace(init_from=str(shallow)))
    not_dict = tmp_path / "list.pt"
    torch.save([1, 2], not_dict)
    with pytest.raises(ValueError, match="not a state dict"):
        build_model(cfg.replace(init_from=str(not_dict)))


def test_config_refuses_what_is_not_written():
    for kw, msg in [(dict(lora_rank=2, strategy="tp", world_size=2, tp=2),
                     r"LoRA adapters\): strategy 'tp' does not support it; strategies that do: "
                     "single, allreduce, ddp, ddp-torch, zero1, zero2, zero3$"),
                    (dict(lora_rank=2, lora_targets="("), "neither a preset"),
                    (dict(lora_rank=2, lora_alpha=0.0), "lora_alpha"),
                    (dict(task=-1), "task=-1"),
                    (dict(replay=1.0, task=1), "replay"),
                    (dict(replay=0.2), "set task >= 1"),
                    (dict(ewc_lambda=1.0, task=1), "init_from"),
                    (dict(ewc_lambda=1.0, task=1, init_from="x.pt", strategy="zero2",
                          world_size=2), r"ewc_lambda > 0 .*strategy 'zero2' does not support it; "
                     "strategies that do: single, allreduce, ddp, ddp-torch$"),
                    (dict(lora_rank=2, model="bnnet"), "written for the GPT")]:
        with pytest.raises(ValueError, match=msg):
            RunConfig(**kw)


# -- LoRA under ddp / zero vs single -------------------------------------------------------------
def _lora_cfg(init_from, **kw):
    return RunConfig(**GPT_KW, task=1, init_from=init_from, lora_rank=RANK, lora_targets=TARGET,
                     optimizer="sgd", lr=0.5, steps=20, **kw)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """One single launch: pre-train task 0 (save_final), then the LoRA reference from it."""
    root = tmp_path_factory.mktemp("lora-single")
    path = str(root / "task0.pt")
    cfgs = [RunConfig(**GPT_KW, steps=60, lr=3e-3, save_final=path),
            _lora_cfg(path),
            _lora_cfg(path, eval_every=10)]
    run_dir = str(root / "run")
    res = run_ranks(train_with_state, 1, [c.to_dict() for c in cfgs], timeout_s=60,
                    threads=1, run_dir=run_dir)[0]
    return {"path": path, "pre": res[0], "single": res[1], "evals": _evals(run_dir)}


def _evals(run_dir):
    return [e for e in Run.load(run_dir).events if e["kind"] == "eval" and e["rank"] == 0]


@pytest.fixture(scope="module")
def parallel(pretrained, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("lora-w2"))
    cfgs = {s: _lora_cfg(pretrained["path"], strategy=s, world_size=2) for s in STRATEGIES}
    cfgs["zero3 eval"] = cfgs["zero3"].replace(eval_every=10)
    res = run_ranks(train_with_state, 2, [c.to_dict() for c in cfgs.values()], timeout_s=60,
                    threads=1, run_dir=run_dir)
    events = [step_events_per_run(run_dir, r) for r in range(2)]
    return {name: {"cfg": c, "ranks": [res[r][i] for r in range(2)],
                   "events": [events[r][i] for r in range(2)]}
            for i, (name, c) in enumerate(cfgs.items())}, _evals(run_dir)


def test_pretrained_file_is_a_plain_state_dict_and_lora_starts_from_it(pretrained):
    state = torch.load(pretrained["path"], weights_only=True)
    assert not any("lora" in k for k in state)
    final = pretrained["single"]["state"]
    for k, v in state.items():  # frozen through 20 LoRA steps: bitwise the pre-trained values
        assert torch.equal(final[k], v), k
    assert any(final[k].abs().max() > 0 for k in final if k.endswith("lora_B"))  # B trained


def test_lora_under_every_strategy_matches_single(pretrained, parallel):
    out, _ = parallel
    ref = pretrained["single"]["state"]
    for name, run in out.items():
        for rank in run["ranks"]:
            state = rank["state"]
            assert state.keys() == ref.keys(), name
            for k, v in state.items():
                if "lora" in k:
                    assert (v - ref[k]).abs().max().item() < ATOL, (name, k)
                else:
                    assert torch.equal(v, ref[k]), (name, k)  # frozen: untouched


def _adapter_units(cfg):
    """Adapter values per block (zero2/3 units) and in all (zero1's one unit, ddp)."""
    model = build_model(cfg.replace(init_from="", strategy="single", world_size=1))
    per_block = [trainable_parameters(b) for b in model.blocks]
    return per_block, sum(per_block)


def test_only_adapter_gradients_travel(pretrained, parallel):
    out, _ = parallel
    N = 2
    per_block, psi = _adapter_units(out["ddp"]["cfg"])
    full = sum(p.numel() for p in GPT(GPTConfig.from_run(out["ddp"]["cfg"])).parameters())
    assert psi == lora_parameter_count(target_shapes(_gpt(), TARGET), RANK)
    expected = {
        "ddp": {"all_reduce": ring_allreduce_bytes(4 * psi, N)},
        "ddp-torch": {"all_reduce": ring_allreduce_bytes(4 * psi, N)},
        "zero1": {"reduce_scatter": (N - 1) / N * 4 * padded_size(psi, N),
                  "all_gather": (N - 1) / N * 4 * padded_size(psi, N)},
        "zero2": {"reduce_scatter": (N - 1) / N * 4 * sum(padded_size(u, N) for u in per_block),
                  "all_gather": (N - 1) / N * 4 * sum(padded_size(u, N) for u in per_block)},
        "zero3": {"reduce_scatter": (N - 1) / N * 4 * sum(padded_size(u, N) for u in per_block),
                  "all_gather": 2 * (N - 1) / N * 4 * sum(padded_size(u, N) for u in per_block)},
    }
    for name, kinds in expected.items():
        for rank_events in out[name]["events"]:
            for e in rank_events:
                sent = {k: v["bytes_sent"] for k, v in e["comm"].items() if v["bytes_sent"]}
                assert sent == {k: int(v) for k, v in kinds.items()}, (name, e["step"], sent)
    # full fine-tuning would all-reduce 4·Ψ_full bytes (x2(N-1)/N): LoRA sends psi/full of it
    assert psi / full < 0.25


def test_eval_events_under_zero3_match_single(pretrained, parallel):
    _, z3 = parallel
    single = pretrained["evals"][-3:]  # the last config of the single launch evaluates
    assert [e["step"] for e in z3] == [0, 10, 20] == [e["step"] for e in single]
    for a, b in zip(z3, single):
        for task in ("task0", "task1"):
            # the same weights (atol 1e-5 above) evaluated on the same rows
            assert abs(a["loss"][task] - b["loss"][task]) < 1e-5
    assert z3[0]["comm"]["all_gather"]["bytes_sent"] > 0  # zero3 gathered its units for it


def test_lora_alpha_over_rank_is_the_scale():
    layer = LoRALinear(torch.nn.Linear(8, 8), rank=4, alpha=2.0)
    assert layer.scale == 0.5
    with torch.no_grad():
        layer.lora_B.fill_(1.0)
    x = torch.randn(3, 8)
    expect = x @ layer.weight.T + layer.bias + 0.5 * (x @ layer.lora_A.T) @ layer.lora_B.T
    assert torch.allclose(layer(x), expect, atol=1e-6)
    assert math.isclose(layer.delta_weight().sum().item(),
                        (0.5 * layer.lora_B @ layer.lora_A).sum().item(), rel_tol=1e-6)
