"""`dp` (nn.DataParallel in one process) and the parameter servers follow `single`, move the bytes
their formulas say, and the backup workers stop a synchronous step from waiting for a straggler.

Equivalence: the same small GPT on the same global batch per step, SGD in float32, 10 steps.
`dp` sums its replicas' gradients (each replica's loss term is weighted by its share of the
rows); `ps-sync` averages N workers' gradients on the server. Mathematically both are the
gradient of the global batch's mean loss; numerically they differ from `single` only in
summation order (float32 rounding, ~1e-7 relative per step). Tolerance atol=1e-5 per parameter,
as in test_equivalence.py: SGD does not amplify rounding (measured on torch 2.13 CPU with gloo:
~6e-8); we observed at most ~7e-8 here over 20 steps (dp 5e-8, ps-sync 7e-8), a >100x margin, while a wrong gradient
(a missing average, a dropped replica or worker) moves parameters by ~1e-2.

ps world sizes 3 and 5 (N = 2 and 4 workers plus the server): each worker then takes the same
rows as `allreduce` at world 2 and 4, and the global batch of 8 divides among them.

Launches cost seconds, so three launches carry every config: one process (single and every dp
config), three ranks (ps-sync and ps-async with 2 workers), five ranks (ps-sync with 4 workers,
and the straggler pair).
"""

import pytest
import torch

from distlab import Run, RunConfig, run_ranks
from distlab.caller.launch import new_run_dir, runs_root
from distlab.models import GPTConfig, gpt_param_count
from distlab.lab.stragglers import summarize_events
from distlab.lab.runs import split_configs
from distlab.rank.train import train_with_state

ATOL = 1e-5
BASE = RunConfig(steps=10, optimizer="sgd", lr=0.1, global_batch=8, seq_len=16, n_layer=2,
                 n_embd=32, n_head=2, mlp_ratio=4, timeout_s=60)
P = gpt_param_count(GPTConfig.from_run(BASE)) * 4  # bytes of fp32 parameters (= of gradients)
DELAY = 0.3  # the straggler's sleep per step; a step of this model takes ~10 ms


def _launch(cfgs, world):
    """Train `cfgs` in turn in one launch of `world` ranks: per config, (results per rank,
    events of that config)."""
    run_dir = new_run_dir(runs_root(), f"test-dp-ps-w{world}")
    # One torch thread per process, even for the one-process launch: two OpenMP threads on a
    # busy 2-core machine made steps up to 100x slower (measured here: a 4-rank DDP step
    # went from 68 ms to 0.5-1.4 s with 2 threads per rank).
    results = run_ranks(train_with_state, world, [c.to_dict() for c in cfgs], timeout_s=60,
                        run_dir=run_dir, wall_timeout_s=180, threads=1)
    events = split_configs(Run.load(run_dir).events, len(cfgs))
    return [([results[r][i] for r in range(world)], events[i]) for i in range(len(cfgs))]


def _worst_param_diff(a, b):
    return max((a["state"][k] - b["state"][k]).abs().max().item() for k in b["state"])


# -- one process: single and dp ------------------------------------------------------------------
DP = {"dp2": BASE.replace(strategy="dp", world_size=2),
      "dp4": BASE.replace(strategy="dp", world_size=4),
      "dp4-loss": BASE.replace(strategy="dp", world_size=4, dp_gather="loss"),
      "dp4-sequential": BASE.replace(strategy="dp", world_size=4, dp_threads=False)}


@pytest.fixture(scope="module")
def one_process():
    out = _launch([BASE] + list(DP.values()), 1)
    return out[0], dict(zip(DP, out[1:]))


def test_dp_matches_single_parameter_by_parameter(one_process):
    (single, _), dp = one_process
    for name, ((res,), events) in dp.items():
        diff = _worst_param_diff(res, single[0])
        assert diff <= ATOL, f"{name}: worst parameter diff {diff:.2e}"
        # the loss dp computes on replica 0 is the global batch's loss
        assert max(abs(a - b) for a, b in zip(res["losses"], single[0]["losses"])) < 1e-5
        print(f"{name}: worst parameter diff vs single {diff:.2e}")


def test_dp_replica0_moves_n_minus_1_times_the_bytes_of_any_other_replica(one_process):
    _, dp = one_process
    x_bytes = BASE.global_batch * BASE.seq_len * 8  # int64 token ids
    logits_bytes = BASE.global_batch * BASE.seq_len * BASE.vocab_size * 4
    for name, (_, events) in dp.items():
        cfg = DP[name]
        n = cfg.world_size
        steps = [e["dp"] for e in events if e["kind"] == "step"]
        assert len(steps) == cfg.steps
        for s in steps:
            b = s["bytes"]
            # formulas (P parameter bytes, X input bytes, O output bytes of the global batch):
            assert b["broadcast"]["sent"][0] == (n - 1) * P  # parameters out
            assert b["reduce_add"]["recv"][0] == (n - 1) * P  # gradients in
            if cfg.dp_gather == "loss":  # inputs and targets out, n-1 losses in
                assert b["scatter"]["sent"][0] == (n - 1) * 2 * x_bytes // n
                assert b["gather"]["recv"][0] == (n - 1) * 4
            else:  # inputs out; logits in (and their gradient back out)
                assert b["scatter"]["sent"][0] == (n - 1) * x_bytes // n
                assert b["gather"]["recv"][0] == (n - 1) * logits_bytes // n
                assert b["grad_scatter"]["sent"][0] == (n - 1) * logits_bytes // n
            for i in range(1, n):  # replica 0 moves exactly n-1 times any other replica's bytes
                assert s["bytes_sent"][0] == (n - 1) * s["bytes_recv"][i]
                assert s["bytes_recv"][0] == (n - 1) * s["bytes_sent"][i]
            assert s["threads"] == (0 if cfg.dp_threads is False else n)
            assert len(s["replica_forward_s"]) == n and s["seconds"]["forward_wall_s"] > 0
            assert s["seconds"]["reduce_add_s"] > 0 and s["replica0_only_s"] > 0


# -- parameter servers ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ps3():
    sync = BASE.replace(strategy="ps-sync", world_size=3)
    asyn = BASE.replace(strategy="ps-async", world_size=3)
    (s, s_ev), (a, a_ev) = _launch([sync, asyn], 3)
    return {"sync": (sync, s, s_ev), "async": (asyn, a, a_ev)}


# global batch 12: it divides among N=4 workers (3 rows each) and N=3 (4 rows each)
STRAGGLER = BASE.replace(strategy="ps-sync", world_size=5, steps=6, global_batch=12,
                         straggler_rank=4, straggler_delay_s=DELAY)


@pytest.fixture(scope="module")
def ps5():
    cfgs = [BASE.replace(strategy="ps-sync", world_size=5),
            STRAGGLER,  # N=4: every update waits for the straggler
            STRAGGLER.replace(backup_workers=1)]  # N=3 of 4 workers: the first 3 are used
    return [(c, *out) for c, out in zip(cfgs, _launch(cfgs, 5))]


@pytest.fixture(scope="module")
def single(one_process):
    return one_process[0][0][0]


def _sync_runs(ps3, ps5):
    return [ps3["sync"], ps5[0]]


def test_ps_sync_matches_single_parameter_by_parameter(ps3, ps5, single):
    for cfg, results, _ in _sync_runs(ps3, ps5):
        for rank, res in enumerate(results):  # the server's master weights and every worker's
            diff = _worst_param_diff(res, single)
            assert diff <= ATOL, f"world {cfg.world_size} rank {rank}: diff {diff:.2e}"
            for k, t in res["state"].items():  # workers hold exactly the weights they pulled
                assert torch.equal(t, results[0]["state"][k]), (rank, k)
        workers = results[1:]
        mean_loss = [sum(w["losses"][s] for w in workers) / len(workers) for s in range(cfg.steps)]
        assert max(abs(a - b) for a, b in zip(mean_loss, single["losses"])) < 1e-5
        print(f"ps-sync world {cfg.world_size}: worst parameter diff vs single "
              f"{max(_worst_param_diff(r, single) for r in results):.2e}")


def test_ps_server_moves_n_times_a_workers_bytes(ps3, ps5):
    # per update: the server receives N gradients and sends N copies of the weights (N·P each
    # way); a worker sends one gradient and receives the weights once (P each way).
    for cfg, results, events in _sync_runs(ps3, ps5):
        n = cfg.dp_degree
        server = [e for e in events if e["kind"] == "step" and e.get("role") == "server"]
        assert [e["step"] for e in server] == list(range(cfg.steps))
        for e in server:
            assert e["loss"] is None and e["grads_used"] == n
            assert e["bytes_in"] == n * P and e["bytes_out"] == n * P
            assert e["comm"]["ps.push"]["bytes_recv"] == n * P
        for res in results[1:]:
            for c in res["comm"]:
                assert c["ps.push"]["bytes_sent"] == P and c["ps.pull"]["bytes_recv"] == P


def test_ps_async_records_staleness_and_trains(ps3):
    cfg, results, events = ps3["async"]
    server = [e for e in events if e["kind"] == "step" and e.get("role") == "server"]
    workers = cfg.world_size - 1
    assert len(server) == workers * cfg.steps  # every gradient applied on its own
    assert all(e["staleness"] >= 0 and e["grads_used"] == 1 for e in server)
    assert all(e["bytes_in"] == P and e["bytes_out"] == P for e in server)
    done = [e for e in events if e["kind"] == "server_done"][0]
    assert done["updates"] == workers * cfg.steps and done["dropped"] == 0
    for res in results[1:]:
        assert len(res["losses"]) == cfg.steps
    losses = [sum(r["losses"][s] for r in results[1:]) / workers for s in range(cfg.steps)]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    print(f"ps-async: staleness mean {done['staleness_mean']:.2f} max {done['staleness_max']}, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def test_backup_workers_stop_the_step_from_waiting_for_the_straggler(ps5):
    (_, _, _), (waits, _, waits_ev), (backup, _, backup_ev) = ps5
    slow = summarize_events(waits_ev, waits)
    fast = summarize_events(backup_ev, backup)
    # Without backup workers every update waits for the straggler's gradient, which comes at
    # least DELAY after its previous reply; with one backup worker the first N=3 come from the
    # fast workers (~10 ms steps). A generous margin: this asserts behaviour, not speed.
    assert slow["update_s"] >= 0.9 * DELAY, slow
    assert fast["update_s"] < 0.5 * DELAY, fast
    # each update used exactly N gradients, and in all b·steps gradients were dropped: every
    # worker pushed `steps` gradients, N·steps of them were used
    server = [e for e in backup_ev if e["kind"] == "step" and e.get("role") == "server"]
    n, b = backup.dp_degree, backup.backup_workers
    assert len(server) == backup.steps
    assert all(e["grads_used"] == n and len(e["workers"]) == n for e in server)
    assert fast["used"] == n * backup.steps and fast["dropped"] == b * backup.steps
    assert all(backup.straggler_rank not in e["workers"] for e in server)  # always too late
    print(f"straggler {DELAY} s: median update {slow['update_s'] * 1e3:.0f} ms without, "
          f"{fast['update_s'] * 1e3:.0f} ms with 1 backup worker")
