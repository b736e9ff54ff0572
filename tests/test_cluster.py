"""Simulated nodes (distlab.caller.cluster): the link between nodes is throttled and the
node's own address is not, the interfaces count the bytes, and nothing the cluster made is
left: after the `with` block, after an error inside it, and after its creator was killed
(clean_leftovers). Root only (network namespaces); skipped, saying so, elsewhere."""

import os
import subprocess
import sys
import textwrap

import pytest

from distlab.caller import cluster as C

pytestmark = pytest.mark.skipif(C.available() is not None,
                                reason=f"simulated nodes unavailable: {C.available()}")

SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 5001)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); n = 0
    while True:
        b = c.recv(1 << 16)
        if not b: break
        n += len(b)
    c.sendall(b"k"); print(n, flush=True)
""")
CLIENT = textwrap.dedent("""
    import socket, sys, time
    c = socket.create_connection((sys.argv[1], 5001), timeout=60)
    data = b"x" * int(sys.argv[2]); t = time.perf_counter()
    c.sendall(data); c.shutdown(socket.SHUT_WR); c.recv(1)
    print(time.perf_counter() - t, flush=True)
""")
PAYLOAD = 2 << 20


def alive(pid: int) -> bool:
    """Running, not a zombie (a dead process its new parent has not reaped yet)."""
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def ours() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines()
            if line.startswith(f"{C.PREFIX}{os.getpid()}-")}


def mbit_per_s(cluster, src, dst) -> float:
    """Send PAYLOAD bytes from node src to node dst's address; Mbit/s as the sender timed it
    (from the first byte to the receiver's acknowledgement: no process start-up in it)."""
    server = cluster.start(dst, [sys.executable, "-c", SERVER, cluster.address(dst)],
                           stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    client = cluster.start(src, [sys.executable, "-c", CLIENT, cluster.address(dst),
                                 str(PAYLOAD)], stdout=subprocess.PIPE, text=True)
    seconds = float(client.communicate(timeout=60)[0])
    assert int(server.communicate(timeout=60)[0]) == PAYLOAD
    return PAYLOAD * 8 / seconds / 1e6


def test_the_link_between_nodes_is_throttled_and_a_nodes_own_address_is_not():
    with C.Cluster(nodes=2, link_mbit=20) as cluster:
        across = mbit_per_s(cluster, 0, 1)
        inside = mbit_per_s(cluster, 1, 1)
        sent, got = cluster.link_bytes(0)["sent"], cluster.link_bytes(1)["received"]
    print(f"\n20 Mbit/s link: across {across:.1f} Mbit/s, inside node 1 {inside:.0f} Mbit/s; "
          f"node 0's link sent {sent:,} bytes, node 1's received {got:,} (payload {PAYLOAD:,})")
    # tbf lets a burst (64 KB) through at once: 2 MiB at 20 Mbit/s stays within 10% of it
    assert across <= 1.1 * 20, across
    assert inside > 5 * 20, inside  # the node's own address never touches the link
    # the payload crossed node 0's link and node 1's, plus headers; inside traffic did not
    assert PAYLOAD <= sent < 1.2 * PAYLOAD and PAYLOAD <= got < 1.2 * PAYLOAD, (sent, got)
    assert not ours()


def test_a_pair_of_nodes_gets_a_link_rate_of_its_own():
    """pair_mbit: nodes 0 and 2 talk at 20 Mbit/s both ways (htb, a class per peer), every
    other pair at the 100 Mbit/s of the nodes' links; bad pairs are refused before anything is
    made."""
    with C.Cluster(nodes=3, link_mbit=100, pair_mbit={(0, 2): 20}) as cluster:
        slow = [mbit_per_s(cluster, 0, 2), mbit_per_s(cluster, 2, 0)]
        fast = mbit_per_s(cluster, 0, 1)
    print(f"\nnodes 0 and 2 at 20 Mbit/s: {slow[0]:.1f} and {slow[1]:.1f} Mbit/s; "
          f"nodes 0 to 1 at 100: {fast:.1f} Mbit/s")
    # a burst (64 KB) goes at once, then the class's rate: within 10% of it, as tbf above
    assert all(0.8 * 20 <= x <= 1.1 * 20 for x in slow), slow
    assert 0.8 * 100 <= fast <= 1.1 * 100, fast
    assert not ours()
    for bad in ({(0, 0): 10}, {(0, 3): 10}, {(0, 1): 0}):
        with pytest.raises(ValueError, match="pair_mbit"):
            C.Cluster(nodes=3, pair_mbit=bad)
    assert not ours()


def test_nothing_is_left_after_an_error_inside_the_block():
    with pytest.raises(ZeroDivisionError):
        with C.Cluster(nodes=3, link_mbit=100) as cluster:
            sleeper = cluster.start(2, [sys.executable, "-c", "import time; time.sleep(60)"])
            assert len(ours()) == 4  # a switch and three nodes
            1 / 0
    assert not ours() and sleeper.poll() is not None


def test_what_a_killed_creator_left_is_cleaned_up():
    script = ("import sys, time; sys.path.insert(0, sys.argv[1]);"
              "from distlab.caller.cluster import Cluster;"
              "c = Cluster(2, 100).up(); print(c.tag, flush=True); time.sleep(60)")
    lib = os.path.dirname(os.path.dirname(C.__file__))
    creator = subprocess.Popen([sys.executable, "-c", script, os.path.dirname(lib)],
                               stdout=subprocess.PIPE, text=True)
    tag = creator.stdout.readline().strip()
    creator.kill()  # SIGKILL: no atexit, no finally
    creator.wait()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert listed.count(tag) == 3, listed  # left behind
    removed = C.clean_leftovers()
    assert sorted(removed) == sorted(f"{tag}-{n}" for n in ("switch", "node0", "node1"))
    assert tag not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                     text=True).stdout


def test_settings_and_permissions_are_checked_before_anything_is_made(monkeypatch):
    with pytest.raises(ValueError, match="2 to 32 nodes"):
        C.Cluster(nodes=1)
    with pytest.raises(ValueError, match="link_mbit=0"):
        C.Cluster(nodes=2, link_mbit=0)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(C.ClusterUnavailable, match="need root"):
        C.Cluster(nodes=2)
    assert not ours()


ARGS = {"strategy": "ddp", "steps": 6, "global_batch": 8, "n_layer": 2, "n_embd": 32,
        "n_head": 2, "seq_len": 16}


def test_a_node_that_dies_mid_run_ends_the_run_and_leaves_no_process(tmp_path):
    """Node 1 fails at step 3 (every process in it SIGKILLed): node 0's rank fails in its next
    collective and its agent exits non-zero. Killing only a torchrun agent leaves its rank
    running on (an orphan, no child of ours): down() ends it too, found by `ip netns pids`."""
    import time

    from distlab.caller.run import Run
    run_dir = tmp_path / "run"
    argv = ["-m", "distlab", "--run-dir", str(run_dir), "--log-every", "0", "--timeout-s", "10"]
    for k, v in {**ARGS, "steps": 500}.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    with C.Cluster(nodes=2, link_mbit=100) as cluster:
        agents = cluster.torchrun(1, argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if run_dir.exists() and len(Run.load(str(run_dir)).history("step", rank=0)) >= 3:
                break
            time.sleep(0.2)
        agents[1].kill()  # the agent alone: its rank is orphaned and trains on
        agents[1].wait()
        orphans = C.processes_in(cluster.namespace(1))
        everything = orphans + C.processes_in(cluster.namespace(0))
        cluster.kill_node(1)
        t0 = time.monotonic()
        agents[0].wait(timeout=60)
        seconds = time.monotonic() - t0
    print(f"\n{len(orphans)} process(es) left in node 1 by its killed agent; node 0's agent "
          f"exited {agents[0].returncode} {seconds:.1f} s after node 1 failed")
    assert orphans and agents[0].returncode != 0
    assert seconds < 10 + 30  # its collective timeout, and the agent's own shutdown
    assert not [p for p in everything if alive(p)], everything
    assert not ours()


def test_the_readme_cluster_snippet_runs(tmp_path, monkeypatch, capfd):
    """docs/cluster.md's snippet (the README's until the reference moved to docs/) as written,
    on a smaller model and fewer steps (2 nodes x 2 ranks on 2 cores): it trains and prints
    node 0's link counters."""
    import pathlib
    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "cluster.md").read_text()
    block = page.split("## Several nodes on one machine", 1)[1]
    code = next(b.split("```", 1)[0] for b in block.split("```python")[1:] if "Cluster(" in b)
    assert '"--steps", "20"' in code, "docs/cluster.md's cluster snippet changed"
    code = code.replace('"--steps", "20"', '"--steps", "3", "--n-layer", "2", "--n-embd", "32",'
                        ' "--n-head", "2", "--seq-len", "16", "--global-batch", "8"')
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/cluster.md", "exec"), {})
    out = capfd.readouterr().out  # the agents write to the same file descriptor
    assert "'sent':" in out and "done: 3 steps" in out, out[-2000:]
    assert not ours()


def test_a_killed_node_replaced_resumes_bit_for_bit(tmp_path):
    """Elastic restart across nodes (distlab.studies.node_fault): node 1 (agent and rank) is
    SIGKILLed after step 6, a new agent joins on it 1 s later; the survivor's agent restarts its
    rank, both load the newest checkpoint (4 steps done) and train to the end. The steps since
    the checkpoint ran twice, with the same losses bit for bit; no process is left in either
    node. (Against a whole uninterrupted run: notebook 17, full mode; one more cluster here.)"""
    from distlab import RunConfig
    from distlab.studies.node_fault import node_fault
    # step_delay_s: rank 0's log is read every 50 ms and the node killed after; a tiny step
    # takes ms, so under CI's load the run once reached step 8 (and its checkpoint) before the
    # kill landed. 0.5 s a step leaves the kill a second before the next checkpoint
    cfg = RunConfig(**{**ARGS, "steps": 12}, world_size=2, nodes=2, link_mbit=100,
                    checkpoint_every=4, timeout_s=10, step_delay_s=0.5)
    r = node_fault(cfg, kill_after=6, folder=str(tmp_path), uninterrupted=False)
    print(f"\nkilled after step {r.killed_after_step}, resumed from {r.resumed_from} steps done, "
          f"first resumed step {r.kill_to_resumed_s:.1f} s after the kill; steps run twice "
          f"{r.rerun}; the run took {r.seconds[1]:.1f} s")
    assert r.resumed_from == 4 and r.rerun[:3] == [4, 5, 6]
    assert sorted(r.recovered) == list(range(12)) and r.rerun_identical and not r.identical
    assert r.exit_codes[0] == 0 and r.exit_codes[-1] == 0 and r.exit_codes[1] == -9
    assert not r.left and not ours()
    with pytest.raises(ValueError, match="after the first checkpoint"):
        node_fault(cfg, kill_after=3, folder=str(tmp_path))
