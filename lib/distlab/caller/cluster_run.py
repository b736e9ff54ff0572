"""A run across simulated nodes: `launch(RunConfig(..., nodes=2, link_mbit=100))`.

The launcher makes the nodes (distlab.caller.cluster: a network namespace per node, links
limited to link_mbit), then starts one real torchrun agent per node, the command a user runs on
a real cluster:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint <node 0>:29400
             --local-addr <this node> -m distlab <the config's flags> --run-dir <run folder>

The ranks write their events into the run's folder as launched ranks do, so a Run reads them,
the dashboard draws them, and the run's end (done, failed, stopped, the kernel interrupted or
gone) removes the namespaces, links and every process in them.

Where simulated nodes cannot be made (not root, no iproute2), the agents run on this machine's
loopback with no link limit, and the run says so in its problems (the dashboard prints them):
its figures then measure no slow link. Never silently.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from distlab.caller import cluster as cluster_mod
from distlab.caller.flags import cli_args
from distlab.caller.run import Run, RunError
from distlab.events import tail

LINKS_FILE = "links.json"
LINK_SAMPLE_S = 0.5
JOIN_MIN_S = 30.0
RDZV_PORT = 29400  # torchrun's default; free inside a node's own namespace


def join_timeout(cfg) -> float:
    """How long an agent waits for every node (torchrun's join timeout; its default is 600 s):
    RunConfig.timeout_s, but never under JOIN_MIN_S, the time an agent's own start (importing
    torch) can take on a loaded machine."""
    return max(cfg.timeout_s, JOIN_MIN_S)


def node_log_path(run_dir: str, node: int) -> str:
    """What node `node`'s torchrun agent printed (its own errors, before any rank logs)."""
    return os.path.join(run_dir, f"node{node}.log")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_on_nodes(cfg, run_dir: str) -> "NodesRun":
    """Start cfg's ranks on cfg.nodes simulated nodes (one torchrun agent each); returns at
    once. The caller (launch) has checked the config and written config.json."""
    per_node = cfg.processes // cfg.nodes
    # every node shares this machine's cores: a rank's threads are its share of them all
    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // cfg.processes)
    argv = ["-m", "distlab", *cli_args(cfg.replace(threads_per_rank=threads)),
            "--run-dir", run_dir, "--log-every", "0"]
    why = cluster_mod.available()
    logs = [open(node_log_path(run_dir, i), "w") for i in range(cfg.nodes)]
    try:
        if why is None:
            cl = cluster_mod.Cluster(cfg.nodes, cfg.link_mbit, cfg.pair_mbit).up()
            try:
                agents = cl.torchrun(per_node, argv, port=RDZV_PORT, outputs=logs,
                                     join_timeout_s=join_timeout(cfg))
            except BaseException:
                cl.down()
                raise
            note = None
        else:
            cl, agents = None, _host_agents(cfg.nodes, per_node, argv, logs, join_timeout(cfg),
                                            os.path.join(run_dir, "agents"))
            note = (f"simulated nodes are not available here ({why}): the {cfg.nodes} nodes "
                    "ran on this machine's loopback with no link limit, so no figure of this "
                    "run measures a slow link")
    finally:
        for f in logs:
            f.close()
    run = NodesRun(run_dir, cfg, agents, cl)
    if note:
        run.problems.append(note)
    return run


def _host_agents(nodes: int, per_node: int, argv: list[str], logs: list,
                 join_timeout_s: float, log_dir: str) -> list:
    """The fallback: one agent per "node", all on 127.0.0.1, nothing throttled. log_dir:
    torchrun's folder for the agents (else a torchelastic_* folder in the system's temp that
    nothing removes)."""
    port, tag = _free_port(), f"distlab-{os.getpid()}-{_free_port()}"
    agents = []
    for i in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
               "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tag,
               "--local-addr", "127.0.0.1", "--log-dir", os.path.join(log_dir, f"node{i}"),
               "--rdzv-conf", f"join_timeout={max(1, round(join_timeout_s))}"] + argv
        agents.append(subprocess.Popen(cmd, stdout=logs[i], stderr=subprocess.STDOUT,
                                       env={**os.environ, "OMP_NUM_THREADS": "1"},
                                       start_new_session=True))
    return agents


class _RankSlot:
    """What Run needs of a rank's process, for a rank a torchrun agent started: the agents
    stand in. Which node runs which block of ranks is the rendezvous's choice, so no slot
    claims one agent: a slot has exited once every agent has, with the first failing agent's
    code (an agent ends its workers and exits non-zero when one fails; the other nodes'
    ranks then fail in their next collective and log it)."""

    def __init__(self, agents: list, pid: int):
        self.agents, self.pid = agents, pid

    @property
    def exitcode(self):
        codes = [a.poll() for a in self.agents]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def join(self, timeout: float | None = None) -> None:
        for a in self.agents:
            try:
                a.wait(timeout)
            except subprocess.TimeoutExpired:
                return

    def terminate(self) -> None:
        for a in self.agents:
            if a.poll() is None:
                a.terminate()  # torchrun passes SIGTERM on to its workers

    def kill(self) -> None:
        for a in self.agents:
            if a.poll() is None:
                a.kill()


class NodesRun(Run):
    """A Run whose ranks torchrun agents started, one agent per simulated node."""

    def __init__(self, run_dir: str, cfg, agents: list, cluster=None):
        self.agents, self.cluster = agents, cluster
        self.links: list = []  # per node {"sent", "received"} bytes, once the run has ended
        self._link_samples: list = []  # (steps done, bytes sent per node) as the run goes
        self._sampled = 0.0  # when the counters were last read
        self._links_lock = threading.Lock()
        per_node = cfg.processes // len(agents)
        slots = [_RankSlot(agents, agents[r // per_node].pid) for r in range(cfg.processes)]
        super().__init__(run_dir, cfg=cfg, processes=slots)

    def _signal_rank(self, p, sig):
        """To the agent (its workers follow); never to a process group it does not lead."""
        import signal
        (p.kill if sig == signal.SIGKILL else p.terminate)()

    def _end_groups(self):
        """The nodes go, and everything inside them; first each link's byte counters are kept
        (self.links, and links.json in the run's folder)."""
        if self.cluster is not None and self.cluster.made:
            self.link_bytes_per_step(force=True)  # the last reading, every step done
            self.links = self._read_links()
            with self._links_lock:
                self.cluster.down()
        for a in self.agents:
            if a.poll() is None:
                a.kill()
                a.wait(10)

    def _read(self) -> list:
        """The ranks' new events; and the links' counters with the steps done, at most every
        LINK_SAMPLE_S (each reading runs `ip` in every node), so a run nobody watches still
        has its figure."""
        new = super()._read()
        if new and time.time() - self._sampled >= LINK_SAMPLE_S:
            self.link_bytes_per_step()
        return new

    def link_bytes_per_step(self, force: bool = False) -> list | None:
        """Bytes each node's link sent per training step, from its interface's counters: as
        the ranks read them at each step's end, once two steps of every node carry them
        (rank_link_bytes_per_step: exact); until then sampled from here.

        Each reading of the counters keeps its time; the steps done by then are counted later,
        from the ranks' step events' own times (the events reach this process up to a poll
        later than the bytes reach the counters; counting them at reading time would credit a
        step's bytes to too few steps). The figure is the slope of the bytes over the steps
        done, across the readings after the first finished step. None until readings span two
        step counts; after the run, the last figure."""
        if self.cluster is None:
            return None
        with self._links_lock:
            due = force or time.time() - self._sampled >= LINK_SAMPLE_S
            if self.cluster.made and due:  # up: read the counters now
                self._sampled = time.time()
                try:
                    sent = [self.cluster.link_bytes(i)["sent"] for i in range(self.cluster.nodes)]
                    self._link_samples.append((time.time(), sent))
                except (OSError, RuntimeError, ValueError):  # going down meanwhile
                    pass
            samples = list(self._link_samples)
        exact = rank_link_bytes_per_step(self, [self.cluster.interface(i)
                                                for i in range(self.cluster.nodes)])
        if exact is not None:
            return exact
        counted = [(self.steps_done(until=t), sent) for t, sent in samples]
        counted = [(n, sent) for n, sent in counted if n >= 1]
        if len({n for n, _ in counted}) < 2:
            return None
        # The least-squares slope of bytes on steps done: a reading lands anywhere inside a
        # step, so the counter holds a part of the step in progress; over many readings that
        # part averages out (two readings alone were 12% low at 25 Mbit/s, 1.7 s a step)
        n = [c[0] for c in counted]
        mean_n = sum(n) / len(n)
        var = sum((x - mean_n) ** 2 for x in n)
        out = []
        for node in range(len(counted[0][1])):
            b = [c[1][node] for c in counted]
            mean_b = sum(b) / len(b)
            out.append(sum((x - mean_n) * (y - mean_b) for x, y in zip(n, b)) / var)
        return out

    def _behind_a_timeout(self, codes: dict):
        """Run's diagnosis of a collective that timed out, with what only the cluster knows:
        a node whose link is down. And, since torchrun's workers dump no stack, the traceback
        of the rank that waited."""
        err = super()._behind_a_timeout(codes)
        if err is None:
            return None
        down = []
        if self.cluster is not None and self.cluster.made:
            try:
                down = [i for i in range(self.cluster.nodes) if not self.cluster.link_is_up(i)]
            except (OSError, RuntimeError, ValueError):
                pass
        msg = err.message
        if down:
            msg = (f"node {', '.join(map(str, down))}'s link is down: no collective across it "
                   f"can complete, so the ranks timed out waiting for their peers. {msg}")
        if err.traceback:
            return RunError(err.rank, msg, err.traceback, err.step)
        # no stack of the rank behind: the traceback of the first rank that timed out waiting
        # for it, under that rank's number (RunError prints "traceback of rank <rank>")
        msg = msg.replace("; its stack below", "")
        waited = [e for e in self.history("error") if e.get("traceback")]
        if not waited:
            return RunError(err.rank, msg, "", err.step)
        first = min(waited, key=lambda e: e["time"])
        return RunError(first["rank"], f"{msg}. Rank {first['rank']} timed out first",
                        first["traceback"], first.get("step"))

    def _stalled(self):
        """Also: an agent that ended before any rank started, seen at once (the others would
        wait out the join timeout for its node)."""
        if not self.history("start") and any(a.poll() not in (None, 0) for a in self.agents):
            return self._never_joined()
        return super()._stalled()

    def _never_joined(self) -> RunError:
        """Which node never joined: its agent ended before the rendezvous did; the others
        were still waiting, or waited the join timeout and gave up."""
        logs = {i: tail(node_log_path(self.dir, i), 20000).strip() or "(nothing)"
                for i in range(len(self.agents))}
        waited = [i for i, t in logs.items() if "RendezvousTimeoutError" in t]
        waiting = [i for i, a in enumerate(self.agents) if a.poll() is None]
        gone = [i for i in range(len(self.agents)) if i not in waited and i not in waiting]
        codes = {i: self.agents[i].returncode for i in gone}
        said = "\n".join(f"node {i}'s agent: {logs[i][-1500:]}" for i in gone)
        others = ([f"node(s) {', '.join(map(str, waiting))} were still waiting for it"]
                  if waiting else [])
        others += ([f"node(s) {', '.join(map(str, waited))} waited {join_timeout(self.cfg):g} s "
                    "(torchrun's join timeout) and gave up"] if waited else [])
        return RunError(0, f"the nodes never all joined the rendezvous: node(s) "
                           f"{', '.join(map(str, gone))} left before it completed (agent exit "
                           f"codes {codes}); {'; '.join(others) or 'no other node waited'}. No "
                           f"rank started.\n{said}", "", 0)

    def _read_links(self) -> list:
        """Bytes each node's link carried, from its interface's own counters."""
        try:
            links = [self.cluster.link_bytes(i) for i in range(self.cluster.nodes)]
            with open(os.path.join(self.dir, LINKS_FILE), "w") as f:
                json.dump({"link_mbit": self.cluster.link_mbit, "nodes": links}, f)
            return links
        except (OSError, RuntimeError, ValueError) as e:
            self.problems.append(f"the links' byte counters could not be read: {e}")
            return []

    def _dump_stack(self, r: int) -> str:
        return ""  # torchrun's workers install no stack dumper; their node logs say more

    def _root_cause(self, codes: dict):
        if not self.history("start"):  # no rank started: the rendezvous never completed
            return self._never_joined()
        err = super()._root_cause(codes)
        if err.traceback:
            return err
        said = "\n".join(f"node {i}'s agent: "
                         + (tail(node_log_path(self.dir, i), 2000).strip() or "(nothing)")
                         for i in range(len(self.agents)))
        return RunError(err.rank, f"{err.message}\n{said}", "", err.step)


def rank_link_bytes_per_step(run, devices: list[str] | None = None) -> list[float] | None:
    """Bytes each node's link sent per step, from the counters its ranks read at each step's
    end (distlab.rank.step_meter): per link device (in `devices` order, else by name), the
    lowest rank's readings, from the end of the first step to the end of the last, over the
    steps between. Every step after the first is in it whole, whatever it sends when (a DiLoCo
    average every 8th step). None until every device has two readings. Measured under the
    suite's load, this figure stayed within the physical bounds where the slope sampled from
    outside read 2.4x the gradients on one node (CI, 2026-11-26)."""
    first_rank: dict[str, int] = {}
    for e in run.history("step"):
        if "link" in e:
            dev = e["link"]["dev"]
            first_rank[dev] = min(first_rank.get(dev, e["rank"]), e["rank"])
    if not first_rank or (devices is not None and set(devices) != set(first_rank)):
        return None
    out = []
    for dev in devices or sorted(first_rank):
        ev = [e for e in run.history("step", rank=first_rank[dev]) if "link" in e]
        if len(ev) < 2:
            return None
        out.append((ev[-1]["link"]["sent"] - ev[0]["link"]["sent"])
                   / (ev[-1]["step"] - ev[0]["step"]))
    return out
