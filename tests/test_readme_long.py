"""The README's "Long sequences and experts in your model" snippet under torchrun on 2 ranks:
a user's own attention module through distlab.ContextParallel and a distlab.MoE spread by
expert_parallel, each rank holding half of every sequence and half of the experts. It runs
to the end, every step's loss (rank 0 prints the mean over the ranks) is finite, and it
learns the task (each token 3 more than the last: the last loss below half the first)."""

import math

from api_models import run_readme_snippet


def test_the_readme_long_sequence_and_experts_snippet_runs_under_torchrun(tmp_path):
    proc = run_readme_snippet("train_long.py", "long sequences and experts", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"step {s}" for s in range(10)], lines
    losses = [float(line.split("loss ")[1]) for line in lines]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses  # 2.97 -> 0.05 when written
