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
