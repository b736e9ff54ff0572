"""The same `train` runs under torchrun (env:// rendezvous): the path to clusters.

torchrun starts two workers of `python -m distlab`; they write the same event log a spawned
launch writes. The run must equal a spawned launch of the same config exactly: same data, same
initial weights, same reduction (gloo's all-reduce over the same two ranks), so the losses
agree bit for bit.
"""

import os
import subprocess
import sys

from distlab import Run, RunConfig, launch

CFG = RunConfig(strategy="allreduce", world_size=2, steps=6, global_batch=4, seq_len=8,
                n_layer=1, n_embd=16, n_head=2, timeout_s=30)


def test_torchrun_runs_the_same_training_as_a_spawned_launch(tmp_path):
    run_dir = tmp_path / "torchrun-run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "distlab", "--strategy", "allreduce", "--steps", "6", "--global-batch", "4",
           "--seq-len", "8", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
           "--timeout-s", "30", "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    under_torchrun = Run.load(str(run_dir))
    assert under_torchrun.cfg.world_size == 2
    assert {e["rank"] for e in under_torchrun.history("done")} == {0, 1}
    assert under_torchrun.info("backend") == "gloo"
    spawned = launch(CFG).wait(timeout=120)
    assert under_torchrun.losses() == spawned.losses()
    assert len(spawned.losses()) == 6
