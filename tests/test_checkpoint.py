"""Training checkpoints (distlab.checkpoint) and the fault drills.

Bitwise claims use SGD in fp32 at the same world size: a resumed run replays the same data
(a function of the step), the same reductions over the same ranks and the same optimizer
state, so nothing may differ, not even in the last bit. One AdamW + fp16 run (the preemption
drill) checks the optimizer moments and the dynamic loss scaler's state the same way. A resume
at another world size sums gradients over other ranks in another order: equal to rounding only
(there AdamW, so the moments must be re-cut; its tolerance says why).

References come from one launch that trains every config to the end (train_with_state), each
saving its own checkpoints, so the drills compare against them without launching them again.
"""

import contextlib
import json
import os
import shutil
import time

import pytest
import torch
from test_process_safety import assert_all_gone, wait_for_step

from distlab import CheckpointError, RunConfig, RunError, launch, resume, run_ranks
from distlab.checkpoint.reshard import canonical
from distlab.checkpoint.store import crc32_file
from distlab.checkpoint import (Checkpointer, check_compatible, latest_checkpoint,
                                list_checkpoints, load_full, read_meta, verify)
from distlab.comm import Comm
from distlab.events import LogTail, rank_log_path, step_events_per_run
from distlab.lab.checkpoints_and_faults import attempts, torchrun
from distlab.parallel import make_strategy
from distlab.rank.precision import make_loss_scaler
from distlab.rank.train import train_with_state
from distlab.rank.build import build_model, build_optimizer

# A tiny GPT, SGD, fp32: steps cost milliseconds, so the tests measure the checkpoints.
TINY = RunConfig(strategy="ddp", world_size=2, steps=8, global_batch=8, seq_len=16, n_layer=2,
                 n_embd=32, n_head=2, optimizer="sgd", lr=0.1, timeout_s=30,
                 checkpoint_every=3, keep_last=10)
# The preemption drill's run: AdamW and fp16 with the dynamic loss scaler (state to restore).
FP16 = TINY.replace(strategy="allreduce", optimizer="adamw", lr=1e-2, precision="fp16",
                    steps=12, checkpoint_every=100)
REFS = {"ddp": TINY, "ddp async": TINY.replace(checkpoint_async=True),
        "zero3": TINY.replace(strategy="zero3", keep_last=2),
        "fsdp": TINY.replace(strategy="fsdp-torch"),
        "allreduce": TINY.replace(strategy="allreduce"), "fp16": FP16}


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """Every reference config trained uninterrupted in one launch of 2 ranks."""
    root = tmp_path_factory.mktemp("refs")
    cfgs = {k: c.replace(checkpoint_dir=str(root / k)) for k, c in REFS.items()}
    out = run_ranks(train_with_state, 2, [c.to_dict() for c in cfgs.values()],
                    run_dir=str(root / "run"), timeout_s=60, wall_timeout_s=300)
    events = [attempts(str(root / "run"), r) for r in range(2)]  # one list per config
    # "losses" as Run.losses() makes them: the mean over the ranks of each rank's own loss
    return {k: {"cfg": cfgs[k], "losses": [sum(v) / 2 for v in zip(*(o[i]["losses"] for o in out))],
                "rank0_losses": out[0][i]["losses"], "state": out[0][i]["state"],
                "root": str(root / k), "events": [ev[i] for ev in events]}
            for i, k in enumerate(cfgs)}


def final_tensors(root):
    return load_full(latest_checkpoint(root))["tensors"]


def assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max |diff| {(a[k] - b[k]).abs().max().item()}"


def test_reference_checkpoints_only_rank0_writes_full_every_rank_writes_its_shard(refs):
    ddp = [e for e in refs["ddp"]["events"][0] + refs["ddp"]["events"][1]
           if e["kind"] == "checkpoint"]
    assert sorted({e["steps_done"] for e in ddp}) == [3, 6, 8]  # every 3 steps and the last
    for e in ddp:  # full format: rank 0 writes state.pt; rank 1 only its RNG states
        assert ("state.pt" in e["files"]) == (e["rank"] == 0)
        assert list(e["files"]) == (["state.pt", "rng/rank0.pt"] if e["rank"] == 0
                                    else ["rng/rank1.pt"])
    for name in ("zero3", "fsdp"):  # sharded: each rank its own DCP file, about half the total
        meta = read_meta(latest_checkpoint(refs[name]["root"]))
        shard = {r: sum(v["bytes"] for k, v in meta["files"].items()
                        if k.startswith(f"dcp/__{r}_")) for r in range(2)}
        assert all(shard.values())
        # zero3's shards hold exactly half of each flat unit (1 entry of padding at most);
        # fsdp's differ more: DCP stores each replicated AdamW `step` once, on one rank
        total = sum(shard.values())
        assert abs(shard[0] - total / 2) < (0.02 if name == "zero3" else 0.15) * total, shard
    # the sharded checkpoint, read back whole, holds the same model as the full one:
    # SGD fp32, ZeRO-3 vs DDP at 2 ranks, agree to ~6e-8 (tests/test_zero.py) -> atol 1e-6
    ddp_model, zero_model = (load_full(latest_checkpoint(refs[k]["root"]))["model"]
                             for k in ("ddp", "zero3"))
    assert ddp_model.keys() == zero_model.keys()
    for k in ddp_model:
        torch.testing.assert_close(zero_model[k], ddp_model[k], atol=1e-6, rtol=0)
        assert torch.equal(zero_model[k], refs["zero3"]["state"][k])  # unflattened exactly


def test_keep_last_prunes_and_leaves_no_temporaries(refs):
    assert [s for s, _ in list_checkpoints(refs["ddp"]["root"])] == [3, 6, 8]  # keep_last=10
    assert [s for s, _ in list_checkpoints(refs["zero3"]["root"])] == [6, 8]  # keep_last=2
    assert not [n for n in os.listdir(refs["ddp"]["root"]) if n.startswith(".")]


def test_asynchronous_saves_equal_synchronous_ones_and_resume_bitwise(refs):
    """checkpoint_async: the periodic saves (after steps 3 and 6) staged and written by a
    thread while training went on, the final one synchronous. Every checkpoint holds the
    synchronous run's tensors bitwise, and a run resumed from step 6's ends as the
    uninterrupted one."""
    sync, bg = refs["ddp"], refs["ddp async"]
    assert [s for s, _ in list_checkpoints(bg["root"])] == [3, 6, 8]
    for (s1, a), (s2, b) in zip(list_checkpoints(sync["root"]), list_checkpoints(bg["root"])):
        assert s1 == s2 and sorted(os.listdir(a)) == sorted(os.listdir(b))  # no records left
        assert set(verify(b)["files"]) == {"state.pt", "rng/rank0.pt", "rng/rank1.pt"}
        assert_bitwise(load_full(a)["tensors"], load_full(b)["tensors"])
    saves = [e for e in bg["events"][0] if e["kind"] == "checkpoint"]
    assert [e["background"] for e in saves] == [True, True, False]
    written = [e["steps_done"] for e in bg["events"][0] if e["kind"] == "checkpoint_written"]
    assert written == [3, 6]
    resumed = launch(bg["cfg"].replace(resume_from=os.path.join(bg["root"], "step_000006"),
                                       checkpoint_dir=bg["root"] + "-resumed")).wait(timeout=120)
    assert resumed.history("resume")[0]["steps_done"] == 6
    assert_bitwise(final_tensors(bg["root"] + "-resumed"), final_tensors(sync["root"]))


def test_a_background_save_that_fails_commits_nothing_and_says_so(tmp_path):
    """The writer's error reaches the loop at the next wait, naming the step; nothing is
    committed, so the checkpoint before it stays the newest. A rank whose records never come
    leaves rank 0's commit waiting only its timeout."""
    from distlab.checkpoint.async_save import WRITTEN, BackgroundSave
    meta = {"format": "full"}
    gone = BackgroundSave({"state.pt": {"x": torch.ones(2)}}, str(tmp_path / "missing"), 0, 1,
                          9, 5.0, {"final": str(tmp_path / "step_000009"),
                                   "root": str(tmp_path), "meta": meta, "keep_last": 2})
    with pytest.raises(RuntimeError, match="background save of step 9 failed: "
                                           "FileNotFoundError"):
        gone.wait()
    tmp = tmp_path / ".step_000012.tmp"
    (tmp / WRITTEN).mkdir(parents=True)
    alone = BackgroundSave({"state.pt": {"x": torch.ones(2)}}, str(tmp), 0, 2, 12, 0.3,
                           {"final": str(tmp_path / "step_000012"), "root": str(tmp_path),
                            "meta": meta, "keep_last": 2})
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not finish writing within 0.3 s"):
        alone.wait()
    assert not (tmp_path / "step_000012").exists() and not (tmp_path / "step_000009").exists()


def test_a_background_save_on_a_full_disk_says_so_and_frees_its_space(tmp_path, monkeypatch):
    """ENOSPC in the writer thread: the error names the full disk and the step, the partial
    save's folder is gone (it must not hold the disk), nothing is committed."""
    import errno
    from distlab.checkpoint import async_save

    def full(path, obj, rank):
        with open(path, "wb") as f:
            f.write(b"x" * 1000)  # what a write leaves before the disk fills
        raise OSError(errno.ENOSPC, "No space left on device", path)
    monkeypatch.setattr(async_save, "write_file", full)
    tmp = tmp_path / ".step_000015.tmp"
    (tmp / async_save.WRITTEN).mkdir(parents=True)
    save = async_save.BackgroundSave({"state.pt": {"x": torch.ones(2)}}, str(tmp), 0, 1, 15, 5.0,
                                     {"final": str(tmp_path / "step_000015"),
                                      "root": str(tmp_path), "meta": {"format": "full"},
                                      "keep_last": 2})
    with pytest.raises(CheckpointError, match="no space left on device writing step 15's "
                                              "checkpoint in the background"):
        save.wait()
    assert not tmp.exists() and not (tmp_path / "step_000015").exists()


def test_sigkill_mid_run_is_reported_and_resume_is_bitwise(refs):
    cfg = TINY.replace(fault="kill", fault_rank=1, fault_step=7)
    run = launch(cfg)
    with pytest.raises(RunError) as e:
        run.wait(timeout=120)
    assert e.value.rank == 1 and e.value.step == 7 and "SIGKILL" in e.value.message
    assert run.ended - run.history("fault")[0]["time"] < 10.0  # the caller knew within 10 s
    assert_all_gone(run.pids)
    assert run.losses() == refs["ddp"]["losses"][:7]
    root = os.path.join(run.dir, "checkpoints")
    assert [s for s, _ in list_checkpoints(root)] == [3, 6]
    resumed = resume(run).wait(timeout=120)  # from step_000006: steps 6 and 7 again
    assert resumed.history("resume")[0]["steps_done"] == 6
    assert resumed.losses() == refs["ddp"]["losses"][6:]
    assert_bitwise(final_tensors(root), final_tensors(refs["ddp"]["root"]))
    # the RNG states were restored: nothing drew from them after, so they are the saved ones
    saved = load_full(os.path.join(root, "step_000006"))["rng"]
    final = load_full(os.path.join(root, "step_000008"))["rng"]
    for r in range(2):
        assert torch.equal(saved[r]["torch"], final[r]["torch"])
        assert saved[r]["python"] == final[r]["python"]


def test_kill_during_a_sharded_write_keeps_the_previous_checkpoint(refs):
    # rank 1 of zero3 dies halfway through writing its shard of the save after step 5
    cfg = TINY.replace(strategy="zero3", fault="kill_in_save", fault_rank=1, fault_step=5)
    run = launch(cfg)
    with pytest.raises(RunError) as e:
        run.wait(timeout=120)
    assert e.value.rank == 1 and "SIGKILL" in e.value.message
    assert_all_gone(run.pids)
    root = os.path.join(run.dir, "checkpoints")
    torn = os.path.join(root, ".step_000006.tmp")
    assert os.path.isdir(torn) and not os.path.exists(os.path.join(torn, "meta.json"))
    assert latest_checkpoint(root).endswith("step_000003")  # the torn save is not a checkpoint
    verify(latest_checkpoint(root))  # every file of the previous one is intact
    resumed = resume(run).wait(timeout=120)
    assert resumed.losses() == refs["zero3"]["losses"][3:]
    assert_bitwise(final_tensors(root), final_tensors(refs["zero3"]["root"]))
    assert not os.path.exists(torn)  # the next complete save cleared it


def test_preempted_job_saves_leaves_and_resumes_exactly_with_adamw_and_the_loss_scaler(refs):
    run = launch(FP16.replace(step_delay_s=0.2))
    wait_for_step(run, 2)
    run.preempt(grace_s=60)  # SIGTERM to every rank: the spot instance's notice
    run.wait(timeout=60)
    assert run.status == "preempted" and run.error is None
    assert_all_gone(run.pids)
    notices = run.history("preempted")
    assert len(notices) == 2 and len({e["step"] for e in notices}) == 1  # both left together
    step = notices[0]["step"]
    path = latest_checkpoint(os.path.join(run.dir, "checkpoints"))
    assert read_meta(path)["reason"] == "preempted" and read_meta(path)["steps_done"] == step + 1
    assert step + 1 < FP16.steps
    resumed = resume(run, step_delay_s=0.0).wait(timeout=120)
    assert resumed.losses() == refs["fp16"]["losses"][step + 1:]
    mine, ref = final_tensors(os.path.join(run.dir, "checkpoints")), final_tensors(
        refs["fp16"]["root"])
    assert "scaler/scale" in ref and any("exp_avg_sq" in k for k in ref)
    assert_bitwise(mine, ref)


def load_here_save_again_and_train_on(rank, world, device, log, cfg_dicts, copy_to):
    """In each rank, per config: build the strategy as distlab.rank.train does, restore resume_from
    at this world size and save it again under copy_to; then train the rest of the run from the
    checkpoint (train_with_state)."""
    out = []
    for d, folder in zip(cfg_dicts, copy_to):
        cfg = RunConfig.from_dict(d)
        comm = Comm()
        torch.manual_seed(cfg.seed)
        strategy = make_strategy(cfg, comm)
        strategy.log = log
        model = strategy.wrap(build_model(cfg).to(device))
        optimizer = strategy.build_optimizer(model, lambda params: build_optimizer(cfg, params))
        ckpt = Checkpointer(cfg.replace(checkpoint_dir=folder), rank, world, device,
                            strategy, model, optimizer, make_loss_scaler(cfg, comm), log)
        ckpt.save(ckpt.restore() - 1, reason="copy")
        out += train_with_state(rank, world, device, log, [d])
    return out


# checkpoints resumed under another strategy (distlab.checkpoint.reshard), at 2 ranks: written
# at 4 by the first, read by the second
ACROSS = [("zero3", "ddp"), ("ddp", "zero3"), ("zero1", "zero2"), ("fsdp-torch", "ddp"),
          ("zero3", "tp"), ("ddp", "tp"), ("zero3", "pp"), ("ddp", "pp"), ("3d", "ddp"),
          ("ddp", "3d"), ("mesh", "ddp"), ("ddp", "mesh")]  # tp, pp, 3d, mesh save whole, in
# ddp's layout
DEGREES = {"tp": {"tp": 2}, "pp": {"pp": 2}, "3d": {"pp": 2}, "mesh": {"tp": 2}}  # at 2 ranks


def test_resume_at_another_world_size_4_to_2(tmp_path):
    # every checkpointing strategy, AdamW (moments to re-cut), saves at 4 ranks after 2 of 4
    # steps; 2 ranks load it (under its own strategy, and under another: ACROSS), save it
    # again, and train the other 2 steps
    names = ["zero1", "zero2", "zero3", "fsdp-torch", "ddp", "zero1-torch"]
    cfgs = [TINY.replace(strategy=s, world_size=4, optimizer="adamw", lr=1e-2, steps=4,
                         checkpoint_every=2, checkpoint_dir=str(tmp_path / s)) for s in names]
    # and a finite dataset under ddp (a sampler's position to carry over): 40 rows, 5 global
    # batches of 8 a pass, at 4 ranks (2 rows each) and at 2 (4 each)
    names.append("ddp-finite")
    cfgs.append(cfgs[4].replace(dataset_size=40, epochs=2, steps=8,
                                checkpoint_dir=str(tmp_path / "ddp-finite")))
    # and 3d: tp2 x dp2 (ZeRO-1's optimizer shards over dp, tp's blocks), resumed by itself at
    # tp2, by ddp, and (a ddp checkpoint) by 3d at pp2
    names.append("3d")
    cfgs.append(cfgs[4].replace(strategy="3d", tp=2, checkpoint_dir=str(tmp_path / "3d")))
    # and the mesh: pp2 x dp_shard2 under fully_shard (ZeRO-3's units, the stages), resumed by
    # ddp and (a ddp checkpoint) by the mesh at tp2
    names.append("mesh")
    cfgs.append(cfgs[4].replace(strategy="mesh", pp=2, checkpoint_dir=str(tmp_path / "mesh")))
    at4 = run_ranks(train_with_state, 4, [c.to_dict() for c in cfgs], timeout_s=60,
                    wall_timeout_s=300, run_dir=str(tmp_path / "at4"))
    saved = [str(tmp_path / s / "step_000002") for s in names]
    pairs = [(n, c.strategy) for n, c in zip(names, cfgs)] + ACROSS  # (written by, read by)
    resumed = [cfgs[names.index(src)].replace(
        strategy=dst, world_size=2, checkpoint_every=0, resume_from=saved[names.index(src)],
        **({"tp": 2, "pp": 1} if src == dst == "3d" else {"tp": 1, "pp": 1, **DEGREES.get(dst, {})}))
        for src, dst in pairs]
    copies = [str(tmp_path / f"{src}-as-{dst}-at-2") for src, dst in pairs]
    at2 = run_ranks(load_here_save_again_and_train_on, 2, [c.to_dict() for c in resumed],
                    copies, timeout_s=60, wall_timeout_s=300, run_dir=str(tmp_path / "at2"))
    # the samples each step read (the union of the ranks' row ids): resumed at 2 ranks after 2
    # steps, the finite run reads exactly what the uninterrupted run at 4 read in steps 2..7
    # (across the pass's end at step 5)
    finite = names.index("ddp-finite")
    ids = {w: [sorted(r for rank in range(w)
                      for r in step_events_per_run(str(tmp_path / f"at{w}"), rank)[finite][k]["rows"])
               for k in range(len(step_events_per_run(str(tmp_path / f"at{w}"), 0)[finite]))]
           for w in (4, 2)}
    assert len(ids[4]) == 8 and len(ids[2]) == 6 and ids[2] == ids[4][2:], ids
    trainable = [n for n, p in build_model(TINY).named_parameters() if p.requires_grad]
    for j, (src, name) in enumerate(pairs):
        # re-cut for 2 ranks and saved again, the checkpoint holds the same tensors, bit for bit
        copy = load_full(os.path.join(copies[j], "step_000002"))
        assert copy["meta"]["world_size"] == 2 and copy["meta"]["strategy"] == name
        original = saved[names.index(src)]
        if name == read_meta(original)["strategy"]:
            assert_bitwise(copy["tensors"], load_full(original)["tensors"])
        else:  # under another layout: the same numbers, parameter by parameter
            a, b = (canonical(p, read_meta(p), trainable) for p in
                    (os.path.join(copies[j], "step_000002"), original))
            assert a["optim"].keys() == b["optim"].keys() == set(trainable)
            assert_bitwise(a["model"], b["model"])
            for n in trainable:
                assert_bitwise(a["optim"][n], b["optim"][n])
        i = names.index(src)  # the uninterrupted run: the source's, at 4 ranks
        # trained on at 2 ranks: 2 ranks sum gradients in another order than 4, and AdamW's
        # m/sqrt(v) amplifies that rounding where v is tiny (measured on torch 2.13 CPU: up to 4e-5 after 5
        # steps at lr 1e-3, as large as fp32 vs fp64). Measured here 1.7e-5..2.1e-5 after 4 steps
        # at lr 1e-2 (2 of them at 2 ranks), so 2e-4; a moment cut at the wrong offset would move
        # parameters by ~lr = 1e-2 per step.
        a = at4[0][i]["state"]
        b = {k: v for rank in at2 for k, v in rank[j]["state"].items()}  # pp: a stage each
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=2e-4, rtol=0, msg=f"{src} as {name} {k}")
        # losses: the mean over ranks of each rank's mean (2 rows at 4 ranks, 4 rows at 2); with
        # parameters 2e-5 apart they measured <= 1.2e-7 apart, so 1e-5
        loss4, loss2 = (torch.tensor([o[k]["losses"] for o in out  # pp: the last stage's
                                      if o[k]["losses"][0] is not None]).double().mean(0)
                        for out, k in ((at4, i), (at2, j)))
        torch.testing.assert_close(loss2, loss4[2:], atol=1e-5, rtol=0, msg=f"{src} as {name}")


def test_torchrun_restarts_workers_that_resume_on_their_own(refs, tmp_path):
    cfg = refs["allreduce"]["cfg"].replace(checkpoint_dir="", resume_from="auto", fault="kill",
                                           fault_rank=1, fault_step=7)
    run_dir = tmp_path / "elastic"
    # torchrun --standalone --nproc_per_node=2 --max-restarts=1 -m distlab <cfg's flags>
    proc = torchrun(cfg, str(run_dir), max_restarts=1)
    assert proc.returncode == 0, proc.stderr[-6000:]
    events = LogTail(rank_log_path(str(run_dir), 0)).read_all()  # both attempts append here
    assert [e["kind"] for e in events].count("start") == 2  # torchrun started workers twice
    i = next(i for i, e in enumerate(events) if e["kind"] == "resume")
    assert events[i]["steps_done"] == 6  # the second attempt found step_000006 on its own
    # torchrun's workers (env:// rendezvous, `python -m distlab`) train what a spawned launch
    # trains, bit for bit: same data, same initial weights, gloo's all-reduce over the same
    # two ranks; before the kill and after the resume
    before = [e["loss"] for e in events[:i] if e["kind"] == "step"]
    assert len(before) >= 6 and before == refs["allreduce"]["rank0_losses"][:len(before)]
    assert [e["loss"] for e in events[i:] if e["kind"] == "step"] == refs["allreduce"][
        "rank0_losses"][6:]
    assert_bitwise(final_tensors(str(run_dir / "checkpoints")),
                   final_tensors(refs["allreduce"]["root"]))


# -- errors: each names what is wrong ----------------------------------------------------------
@pytest.fixture
def ddp_ckpt(refs, tmp_path):
    """A copy of the ddp reference's first checkpoint, to damage."""
    path = tmp_path / "step_000003"
    shutil.copytree(os.path.join(refs["ddp"]["root"], "step_000003"), path)
    return str(path)


def test_a_corrupt_or_truncated_file_is_named(ddp_ckpt):
    state = os.path.join(ddp_ckpt, "state.pt")
    data = bytearray(open(state, "rb").read())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, wrong CRC
    open(state, "wb").write(data)
    with pytest.raises(CheckpointError, match=r"state\.pt: CRC-32 .* corrupt"):
        verify(ddp_ckpt)
    open(state, "wb").write(data[:100])
    with pytest.raises(CheckpointError, match=r"state\.pt is 100 bytes; meta\.json says"):
        load_full(ddp_ckpt)
    os.remove(os.path.join(ddp_ckpt, "meta.json"))
    with pytest.raises(CheckpointError, match=r"meta\.json is missing"):
        read_meta(ddp_ckpt)


class NotATensor:
    """An object of a class of our own: pickle would import and build it, weights_only won't."""


def test_only_tensors_load_weights_only(ddp_ckpt):
    state = os.path.join(ddp_ckpt, "state.pt")
    torch.save({"model": {}, "optimizer": NotATensor()}, state)
    meta = read_meta(ddp_ckpt)
    # size and CRC agree with the new file: only the loader can refuse it
    meta["files"]["state.pt"].update(bytes=os.path.getsize(state), crc32=crc32_file(state))
    with open(os.path.join(ddp_ckpt, "meta.json"), "w") as f:
        json.dump(meta, f)
    with pytest.raises(CheckpointError, match=r"state\.pt cannot be read by "
                                              r"torch\.load\(weights_only=True\).*NotATensor"):
        load_full(ddp_ckpt)


def test_a_mismatched_config_or_strategy_is_named(refs, ddp_ckpt):
    meta = read_meta(ddp_ckpt)
    with pytest.raises(CheckpointError) as e:
        check_compatible(meta, TINY.replace(n_embd=64, lr=0.5), ddp_ckpt)
    assert "n_embd: saved 32, now 64" in str(e.value) and "lr: saved 0.1, now 0.5" in str(e.value)
    with pytest.raises(CheckpointError, match=r"strategy 'zero1-torch' cannot read it\. "
                                              r"Strategies that can: single, allreduce, ddp, "
                                              r"ddp-torch, zero1, zero2, zero3, tp, pp, 3d, mesh, cp$"):
        check_compatible(meta, TINY.replace(strategy="zero1-torch"), ddp_ckpt)
    check_compatible(meta, TINY.replace(strategy="zero3"), ddp_ckpt)  # per parameter: reshard
    # what may change does not count: world size, steps, timeouts
    check_compatible(meta, TINY.replace(strategy="single", world_size=1, steps=50, timeout_s=9))
    # a finite dataset: the world size may change where each step left reads the same sample
    # ids. 64 rows: 8 global batches of 8 a pass at 2 ranks and at 4. 66 rows: at 2 ranks a
    # pass has 9 steps (33 rows each, the last batch short), at 4 it has 8 (2 rows dropped), so
    # the passes part at step 8
    for rows, why in ((64, None), (66, r"step 8 reads other samples at 4 ranks than at 2")):
        finite = dict(meta, config={**meta["config"], "dataset_size": rows, "epochs": 2})
        with pytest.raises(CheckpointError, match=why) if why else contextlib.nullcontext():
            check_compatible(finite, TINY.replace(dataset_size=rows, epochs=2, steps=16,
                                                  world_size=4))
    # resume() checks in the caller, before any process starts
    t0 = time.time()
    with pytest.raises(CheckpointError, match="n_head: saved 2, now 4"):
        resume(refs["ddp"]["root"], n_head=4)
    # the latest checkpoint of a finished run has all its steps done: nothing would train
    with pytest.raises(CheckpointError, match=r"steps done and the run asks for steps="):
        resume(refs["ddp"]["root"])
    assert time.time() - t0 < 5


def test_config_says_which_strategies_and_steps_checkpoint():
    with pytest.raises(ValueError, match="checkpointing is written for single, allreduce"):
        TINY.replace(strategy="pp-torch", pp=2)
    with pytest.raises(ValueError, match="mesh checkpoints are written for flat ZeRO units"):
        TINY.replace(strategy="mesh", fsdp_layout="per_param")
    with pytest.raises(ValueError, match="no checkpoint is written after that step"):
        TINY.replace(fault="kill_in_save", fault_step=3)
    with pytest.raises(ValueError, match="set checkpoint_every > 0"):
        TINY.replace(checkpoint_every=0, fault="kill_in_save", fault_step=2)
    with pytest.raises(ValueError, match="checkpoint_async is written for the full format"):
        TINY.replace(strategy="zero3", checkpoint_async=True)


def test_a_resumed_config_counts_the_steps_it_trains(ddp_ckpt, tmp_path):
    """launch_together's progress line cuts rank 0's steps into configs by the steps each trains:
    a resumed one trains those after its checkpoint (09's resumed runs were cut at cfg.steps and
    read "3 configs" for 4)."""
    from distlab.lab.runs import steps_to_train
    done = read_meta(ddp_ckpt)["steps_done"]
    assert 0 < done < TINY.steps
    assert steps_to_train(TINY.replace(resume_from=ddp_ckpt)) == TINY.steps - done
    assert steps_to_train(TINY) == steps_to_train(TINY.replace(resume_from="auto")) == TINY.steps
    (tmp_path / "empty").mkdir()
    assert steps_to_train(TINY.replace(resume_from=str(tmp_path / "empty"))) == TINY.steps
