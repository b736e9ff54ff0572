"""03 §7 on a machine without a GPU shows the GPU figure recorded in benchmarks/results, read
from benchmarks/gpu.py's own printed output; it says so when none is recorded."""

import shutil

from distlab.lab.memory_and_precision import RESULTS, recorded_gpu_speedup


def test_the_recorded_figure_is_read_from_the_newest_results_file(tmp_path):
    rec = recorded_gpu_speedup()  # the repository's own record
    assert rec is not None and rec["file"].startswith("benchmarks/results/gpu-"), rec
    assert rec["speedup"] > 0 and rec["mfu"] > 0 and "commit" in rec["header"][1], rec
    newer = tmp_path / "gpu-zz-newer.txt"
    shutil.copy(f"{RESULTS}/{rec['file'].rsplit('/', 1)[1]}", tmp_path / "gpu-aa-older.txt")
    newer.write_text("# a test record\n# date: x\n# machine: y\n\n## benchmarks/gpu.py\n"
                     "GPU line\nGPT line\nbf16 / fp32 step-time speed-up: 3.50x (target...)\n"
                     "bf16 MFU: 12.5% (target...)\n")
    got = recorded_gpu_speedup(str(tmp_path))
    assert (got["speedup"], got["mfu"], got["setup"]) == (3.5, 12.5, ["GPU line", "GPT line"])


def test_no_record_says_none(tmp_path):
    assert recorded_gpu_speedup(str(tmp_path)) is None


def test_amp_rows_without_a_gpu_read_not_measured_here_with_the_record_beside():
    from distlab.lab.memory_and_precision import AMP_CLAIM, amp_rows
    rec = recorded_gpu_speedup()
    off, on = amp_rows(None, rec)
    assert (off["claim"], on["claim"]) == (AMP_CLAIM.format("off"), AMP_CLAIM.format("on"))
    assert off["basis"] == on["basis"] == "not measured here" and off["holds"] is None
    assert f"{rec['speedup']}×" in off["figure"] and rec["file"] in off["figure"]
    assert "no figure recorded" in on["figure"]  # benchmarks/gpu.py's record is TF32 off


def test_amp_rows_on_timings_decide_from_each_steps_ratio():
    """The GPU path of 03's AMP rows, fed timings: 2.5x holds, 1.2x does not, and a spread
    across the 2x edge is undecided (no clock read here)."""
    from distlab.lab.memory_and_precision import amp_rows
    bf16 = [1.0, 1.01, 0.99, 1.0, 1.02]
    def t(ratio, wobble=0.01):
        return {"step_samples": [ratio * b * (1 + (-1) ** i * wobble) for i, b in enumerate(bf16)]}
    rows = amp_rows({"fp32, TF32 off": t(2.5), "fp32, TF32 on": t(1.2),
                     "bf16 autocast": {"step_samples": bf16}}, None)
    assert [r["holds"] for r in rows] == [True, False]
    rows = amp_rows({"fp32, TF32 off": t(2.0, 0.2), "fp32, TF32 on": t(3.0, 0.2),
                     "bf16 autocast": {"step_samples": bf16}}, None)
    assert [r["holds"] for r in rows] == [None, None]


def test_amp_timings_restores_tf32_and_times_every_step_on_the_cpu():
    import torch

    from distlab import RunConfig
    from distlab.studies.gpu import AMP_SETTINGS, amp_timings
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    cfg = RunConfig(n_layer=1, n_embd=32, n_head=2, seq_len=16, global_batch=2, vocab_size=64)
    timings = amp_timings(cfg, "cpu", steps=3, warmup=1)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    assert list(timings) == list(AMP_SETTINGS)
    assert all(len(r["step_samples"]) == 3 for r in timings.values())


def test_fsdp_over_nccl_reads_not_measured_here_and_quotes_a_record(tmp_path):
    """04's row: without a record it says what would measure it; with benchmarks/
    zero_overhead.py's NCCL line in a results file it quotes that ratio, still "not measured
    here" (this run did not measure it)."""
    from distlab.lab.zero_and_fsdp import FSDP_NCCL_CLAIM, fsdp_nccl_row, recorded_fsdp_nccl
    assert recorded_fsdp_nccl(str(tmp_path)) is None
    row = fsdp_nccl_row(None)
    assert (row["claim"], row["basis"], row["holds"]) == (FSDP_NCCL_CLAIM, "not measured here",
                                                          None)
    assert "no figure recorded" in row["figure"]
    (tmp_path / "zero_overhead-nccl-h100x8.txt").write_text(
        "NCCL section: 8 x H100\nFSDP2 / DDP step time on NCCL: 1.14x; per repeat 1.12 1.15 1.13\n")
    rec = recorded_fsdp_nccl(str(tmp_path))
    assert rec["ratio"] == 1.14 and rec["per_repeat"] == [1.12, 1.15, 1.13]
    row = fsdp_nccl_row(rec)
    assert "1.14×" in row["figure"] and row["holds"] is None
