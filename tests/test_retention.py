"""distlab.caller.retention: the oldest run folders go first, nothing else under the root is touched,
busy runs stay, and the command line says what it freed."""

from __future__ import annotations

import os
import time

from distlab.caller.launch import new_run_dir
from distlab.caller.retention import folder_bytes, main, prune, run_folders


def _make_runs(root, n, size=1000, age_s=3600):
    made = []
    for i in range(n):
        d = root / f"20260101-0000{i:02d}-ddp-w2-{i:06x}"
        d.mkdir(parents=True)
        (d / "rank0.jsonl").write_bytes(b"x" * size)
        old = time.time() - age_s
        os.utime(d / "rank0.jsonl", (old, old))
        os.utime(d, (old, old))
        made.append(str(d))
    return made


def test_keeps_the_newest_and_never_touches_other_files(tmp_path):
    runs = _make_runs(tmp_path, 5)
    (tmp_path / "your_model.py").write_text("x = 1")
    (tmp_path / "my-checkpoints").mkdir()
    r = prune(str(tmp_path), keep=2)
    assert r["deleted"] == 3 and r["freed"] == 3000 and r["kept"] == 2
    assert run_folders(str(tmp_path)) == runs[-2:]
    assert (tmp_path / "your_model.py").exists() and (tmp_path / "my-checkpoints").is_dir()


def test_a_size_cap_deletes_until_it_holds(tmp_path):
    _make_runs(tmp_path, 4, size=400 * 1024)  # 0.39 MiB each
    r = prune(str(tmp_path), keep=100, max_mb=1.0)
    assert r["kept"] == 2 and r["kept_bytes"] <= 2**20
    assert folder_bytes(str(tmp_path)) == r["kept_bytes"]


def test_a_busy_run_is_kept(tmp_path):
    runs = _make_runs(tmp_path, 3)
    os.utime(os.path.join(runs[0], "rank0.jsonl"))  # just written to: maybe still running
    r = prune(str(tmp_path), keep=0)
    assert r["deleted"] == 2 and run_folders(str(tmp_path)) == runs[:1]


def test_the_launcher_applies_the_rule(tmp_path, monkeypatch):
    _make_runs(tmp_path, 4)
    monkeypatch.setenv("DISTLAB_KEEP_RUNS", "2")
    new = new_run_dir(str(tmp_path), "single-w1")
    left = run_folders(str(tmp_path))
    assert len(left) == 3 and left[-1] == new  # two old ones kept, then the new one


def test_the_command_prints_what_it_freed(tmp_path, capsys):
    _make_runs(tmp_path, 3, size=2**20)
    assert main([str(tmp_path), "--keep", "0"]) == 0
    out = capsys.readouterr().out
    assert "deleted 3 run folders (3.0 MiB); 0 kept" in out and not run_folders(str(tmp_path))


def test_two_launches_pruning_at_once_do_not_fail(tmp_path, monkeypatch):
    """Threads of one process (parallel search workers) each launch, so each prunes: a folder
    the other deleted meanwhile is skipped, not an error."""
    import threading
    _make_runs(tmp_path, 30)
    monkeypatch.setenv("DISTLAB_KEEP_RUNS", "1")
    errors = []

    def make():
        try:
            for _ in range(5):
                new_run_dir(str(tmp_path), "w1")
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)
    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(run_folders(str(tmp_path))) == 20  # the new ones are busy: kept
