"""launch(RunConfig(..., nodes=2, link_mbit=...)): one torchrun agent per simulated node
(distlab.caller.cluster_run). The run trains what the same config trains on one machine, a
failing rank's error reaches the caller, Stop ends it, and after each nothing of the cluster is
left: no namespace this process made, no agent, no rank. Where nodes cannot be made, the run
goes on this machine's loopback and says so.

Simulated nodes need root (network namespaces, tc): CI runs as root; elsewhere the tests that
need them are skipped with the reason."""

from __future__ import annotations

import os
import subprocess

import psutil
import pytest

from distlab import RunConfig, launch
from distlab.caller import cluster, cluster_run
from distlab.caller.run import RunError

pytestmark = pytest.mark.slow
WHY = cluster.available()
needs_nodes = pytest.mark.skipif(WHY is not None, reason=str(WHY))
TINY = dict(global_batch=8, seq_len=16, n_layer=1, n_embd=32, n_head=2, timeout_s=30)
# ddp's gradients are summed by gloo in an order that depends on the ranks' layout: across
# nodes the sum of the same four gradients may round differently in the last bit of fp32;
# six steps of AdamW keep that under 1e-5 of the loss.
LOSS_TOL = 1e-5


def ours() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.startswith(f"{cluster.PREFIX}{os.getpid()}-")]


def descendants() -> list:
    """Agents and their ranks (`-m distlab`) this test process started; not the fork server
    that ordinary launches keep."""
    return [p for p in psutil.Process().children(recursive=True)
            if "torch.distributed.run" in " ".join(p.cmdline())
            or "-m distlab" in " ".join(p.cmdline())]


def assert_nothing_left():
    assert ours() == [], ours()
    assert [p for p in descendants() if p.status() != psutil.STATUS_ZOMBIE] == []


@needs_nodes
def test_a_failing_rank_reaches_the_caller_and_the_nodes_go(tmp_path):
    # one rank per node (as in the tests below): the fewest processes that still cross the
    # link; each torchrun agent and rank imports torch, seconds of CI's 2 cores apiece
    cfg = RunConfig(strategy="ddp", world_size=2, steps=6, nodes=2, fault="raise",
                    fault_rank=1, fault_step=2, runs_root=str(tmp_path), **TINY)
    with pytest.raises(RunError, match="rank 1") as e:
        launch(cfg, block=True)
    assert e.value.rank == 1 and e.value.step == 2
    assert_nothing_left()


@needs_nodes
def test_stop_ends_every_node(tmp_path):
    # link_pairs: the pair's own rate reaches the cluster (tests/test_cluster.py measures it)
    cfg = RunConfig(strategy="ddp", world_size=2, steps=500, nodes=2, step_delay_s=0.05,
                    link_pairs="0-1:50", runs_root=str(tmp_path), **TINY)
    run = launch(cfg)
    import time
    deadline = time.time() + 90
    while run.steps_done() < 2 and time.time() < deadline and not run.done:
        time.sleep(0.2)
    assert run.steps_done() >= 2, run.problems
    run.stop()
    assert run.status == "stopped"
    assert_nothing_left()


@needs_nodes
def test_the_readme_snippet_trains_as_one_machine_and_leaves_nothing(tmp_path):
    """docs/cluster.md's launch across nodes (the README's until the reference moved to docs/)
    as written (a smaller model, fewer steps; a step delay: the links' counters are read at
    most every 0.5 s, the figure per step needs readings across steps): the losses one machine
    gets, the links' bytes, the dashboard's link bars, and nothing left."""
    import pathlib
    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "cluster.md").read_text()
    block = page.split("## Several nodes on one machine", 1)[1]
    code = next(b.split("```", 1)[0] for b in block.split("```python")[1:] if "nodes=2" in b)
    assert "steps=20))" in code, "docs/cluster.md's snippet changed"
    code = code.replace("steps=20))", "steps=6, step_delay_s=0.1, runs_root=ROOT, **TINY))")
    scope = {"ROOT": str(tmp_path), "TINY": TINY}
    exec(compile(code, "docs/cluster.md", "exec"), scope)
    on_nodes = scope["run"]
    assert on_nodes.status == "done" and on_nodes.problems == []
    assert len(on_nodes.losses()) == 6
    local = launch(on_nodes.cfg.replace(nodes=1), block=True)
    worst = max(abs(a - b) for a, b in zip(on_nodes.losses(), local.losses()))
    assert worst < LOSS_TOL, worst
    # each link carried at least the gradients each step, each way: whatever the all-reduce's
    # algorithm, each node must learn the other node's sum of them (the ring sends 1.5x that)
    grads = on_nodes.info("n_params") * 4
    assert len(on_nodes.links) == 2
    for link in on_nodes.links:
        assert link["sent"] >= 6 * grads and link["received"] >= 6 * grads, (link, grads)
    assert os.path.exists(os.path.join(on_nodes.dir, cluster_run.LINKS_FILE))
    # per step, what the dashboard draws: the counters the ranks read at each step's end
    # (notebook 17's race reads the same). A ring's one edge out of each node carries 2(N-1)/N
    # of the gradients, 1.5x at N = 4, plus TCP/IP headers; gloo picks its algorithm by size
    # and timing (on this 69 KB message it has also sent 1.37x and, idle, 1.08-1.10x). No
    # algorithm sends less than the gradients (each node needs the other's sum), nor 2x. The
    # slope sampled from outside, which the dashboard drew before, read 2.4x on one node under
    # CI's load
    per_step = on_nodes.link_bytes_per_step()
    from distlab.lab.multi_node import race_row, race_target, reach_time, steps_link_bytes
    by_ranks = steps_link_bytes(on_nodes)
    assert by_ranks is not None and len(by_ranks) == 2 and per_step == by_ranks
    assert all(grads <= b <= 2 * grads for b in by_ranks), (by_ranks, grads)
    row = race_row("ddp", on_nodes)
    assert row.link_bytes == pytest.approx(sum(by_ranks) / 2) and row.averages == 0
    assert row.seconds == sorted(row.seconds) and len(row.seconds) == 6
    target = race_target(row)
    assert reach_time(row, target) <= row.seconds[-1]  # a loss the run itself reached
    from distlab.lab.panel import LINK_NAME, LiveDashboard
    dash = LiveDashboard([on_nodes])
    dash.refresh()
    bars = next(t for t in dash.fig.data if t.name == LINK_NAME)
    assert list(bars.x) == ["node 0's link", "node 1's link"]
    assert list(bars.customdata) == per_step
    assert_nothing_left()


@needs_nodes
def test_a_node_that_never_joins_is_named_within_the_timeout(tmp_path):
    """Node 1's agent dies before the rendezvous completes: the run fails at once (not after
    the join timeout node 0 would wait), the error naming node 1."""
    import time
    cfg = RunConfig(strategy="ddp", world_size=2, steps=6, nodes=2, runs_root=str(tmp_path),
                    **{**TINY, "timeout_s": 5})
    run = launch(cfg)
    run.agents[1].kill()  # the node never joins
    t0 = time.time()
    with pytest.raises(RunError, match=r"node\(s\) 1 left before it completed") as e:
        run.wait(timeout=120)
    assert time.time() - t0 < cfg.timeout_s + 30
    assert "node(s) 0 were still waiting" in str(e.value)
    assert_nothing_left()


@needs_nodes
def test_a_link_that_goes_down_fails_the_run_within_the_collective_timeout(tmp_path):
    """Node 1's link goes down mid-run: the ranks' collectives time out after
    RunConfig.timeout_s, the run fails with a rank's traceback, and nothing is left."""
    import time
    cfg = RunConfig(strategy="ddp", world_size=2, steps=500, nodes=2, step_delay_s=0.05,
                    runs_root=str(tmp_path), **{**TINY, "timeout_s": 8})
    run = launch(cfg)
    deadline = time.time() + 90
    while run.steps_done() < 2 and time.time() < deadline and not run.done:
        time.sleep(0.2)
    assert run.steps_done() >= 2, run.problems
    run.cluster.link_down(1)
    t0 = time.time()
    with pytest.raises(RunError) as e:
        run.wait(timeout=120)
    took = time.time() - t0
    assert took < cfg.timeout_s + 30, took
    assert "node 1's link is down" in str(e.value), str(e.value)[:2000]
    assert "timed out" in str(e.value), str(e.value)[:2000]
    assert e.value.traceback, "no rank's traceback reached the caller"
    assert run.steps_done() < cfg.steps
    assert_nothing_left()


@needs_nodes
def test_the_readme_slurm_launch_line_runs_in_simulated_nodes(tmp_path):
    """docs/cluster.md's SLURM script (the README's until the reference moved to docs/): its
    `srun` line's command, run once in each of two simulated nodes (what srun does with one
    task per node) with SLURM's variables set, trains what one machine trains (a smaller model
    and fewer steps than the page's)."""
    import pathlib
    import shlex
    import sys
    from distlab.caller.run import Run
    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "cluster.md").read_text()
    script = next(b.split("```", 1)[0] for b in page.split("```bash")[1:] if "#SBATCH" in b)
    line = next(x for x in script.splitlines() if x.startswith("srun "))
    assert "--steps 100" in line, "docs/cluster.md's SLURM line changed"
    small = "--steps 4 --n-layer 1 --n-embd 32 --n-head 2 --seq-len 16 --global-batch 8"
    command = line.removeprefix("srun ").replace("--steps 100", small)
    job = str(os.getpid())
    bin_dir = os.path.dirname(sys.executable)  # the environment's torchrun
    with cluster.Cluster(nodes=2, link_mbit=200) as c:
        procs = [c.start(i, ["bash", "-c", command], cwd=tmp_path, env={
            "SLURM_NNODES": "2", "SLURM_JOB_ID": job,
            "SLURM_LAUNCH_NODE_IPADDR": c.address(0), "SLURMD_NODENAME": c.address(i),
            "GLOO_SOCKET_IFNAME": c.interface(i), "OMP_NUM_THREADS": "1",
            "PATH": f"{bin_dir}:{os.environ['PATH']}"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(2)]
        codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0, 0], (codes, shlex.split(command)[:6])
    run = Run.load(str(tmp_path / "runs" / f"slurm-{job}"))
    cfg = RunConfig(strategy="ddp", world_size=4, steps=4, n_layer=1, n_embd=32, n_head=2,
                    seq_len=16, global_batch=8, runs_root=str(tmp_path / "local"))
    local = launch(cfg, block=True)
    assert len(run.losses()) == 4
    assert max(abs(a - b) for a, b in zip(run.losses(), local.losses())) < LOSS_TOL
    assert_nothing_left()


def test_without_nodes_the_run_goes_on_loopback_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "available", lambda: "simulated nodes need root (a test)")
    cfg = RunConfig(strategy="ddp", world_size=2, steps=3, nodes=2,
                    runs_root=str(tmp_path), **TINY)
    run = launch(cfg, block=True)
    assert run.status == "done" and len(run.losses()) == 3
    assert any("loopback with no link limit" in p and "need root (a test)" in p
               for p in run.problems), run.problems
    assert_nothing_left()


def test_bad_node_settings_fail_before_anything_starts():
    with pytest.raises(ValueError, match="must divide"):
        RunConfig(strategy="ddp", world_size=3, global_batch=6, nodes=2)
    with pytest.raises(ValueError, match="one process"):
        RunConfig(nodes=2)
    with pytest.raises(ValueError, match="link_mbit"):
        RunConfig(strategy="ddp", world_size=2, nodes=2, link_mbit=0.0)
    with pytest.raises(ValueError, match="gloo"):
        RunConfig(strategy="ddp", world_size=2, nodes=2, device="cuda")
    for pairs, said in (("0-1", "i-j:Mbit/s"), ("0-2:5", "two different nodes"),
                        ("0-1:0", "rate > 0")):
        with pytest.raises(ValueError, match=said):
            RunConfig(strategy="ddp", world_size=2, nodes=2, link_pairs=pairs)
    with pytest.raises(ValueError, match="nodes >= 2"):
        RunConfig(strategy="ddp", world_size=2, link_pairs="0-1:5")
    assert RunConfig(strategy="ddp", world_size=4, nodes=2,
                     link_pairs="0-1:25").pair_mbit == {(0, 1): 25.0}
