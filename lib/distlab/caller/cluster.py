"""Simulated nodes on one Linux machine: a network namespace per node, each joined to a switch
(a bridge in a namespace of its own) by a veth link whose rate is limited (tc's tbf), with
addresses from the loopback range only.

    with Cluster(nodes=2, link_mbit=100) as cluster:
        proc = cluster.start(0, [sys.executable, "train.py"])   # inside node 0's namespace
        cluster.address(1)                                       # "127.100.0.2"

Inside a node, processes talk over that node's own address at full speed (the kernel delivers
it locally); between nodes, every byte crosses two links limited to `link_mbit` (the node's
uplink, then the switch's port to the other node). The kernel here has tbf but no netem, so a
link has a rate and no added delay.

Loopback-range addresses leave a namespace only with route_localnet=1 and without the local
route for all of 127.0.0.0/8 (which would keep 127.100.0.2 on the node's own loopback): each
node keeps 127.0.0.1 on its loopback and routes 127.100.0.0/24 over its link.

Needs root (network namespaces and tc); without it, Cluster raises ClusterUnavailable, saying
so: the caller decides what to run instead, and says so too. Everything it makes is named
distlab-<pid>-<n>-...; down() removes it (the `with` block's end, an error inside it, the
interpreter's exit), and clean_leftovers() (`python -m distlab.caller.cluster --clean`) removes
what a process that died without cleaning up left (namespaces whose creating pid is gone).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SUBNET = "127.100.0"  # node i has SUBNET.(i+1); never a private or public address
PREFIX = "distlab-"
_counter = itertools.count()
_LIVE: list["Cluster"] = []  # clusters not yet down (removed at the interpreter's exit)


class ClusterUnavailable(RuntimeError):
    """This machine cannot make simulated nodes (not root, or no `ip`/`tc`)."""


def _ip(*args, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    return done


def available() -> str | None:
    """None when simulated nodes can be made here, else why not (in words)."""
    if sys.platform != "linux":
        return "simulated nodes need Linux network namespaces"
    if os.geteuid() != 0:
        return ("simulated nodes need root (network namespaces, veth links and tc); "
                "run as root, or train on this machine's loopback without a slow link")
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return f"simulated nodes need the `{tool}` command (iproute2)"
    return None


class Cluster:
    """`nodes` namespaces on a switch, each link limited to `link_mbit` Mbit/s each way.
    pair_mbit: a rate of its own for the traffic between two nodes, {(i, j): Mbit/s} (both
    ways; e.g. nodes in two racks): each node's link shapes it per destination (tc's htb, a
    class and a filter on the peer's address) instead of one rate for all (tbf)."""

    def __init__(self, nodes: int = 2, link_mbit: float = 100.0,
                 pair_mbit: dict | None = None):
        if not isinstance(nodes, int) or not 2 <= nodes <= 32:
            raise ValueError(f"nodes={nodes!r}: a cluster has 2 to 32 nodes")
        if not link_mbit > 0:
            raise ValueError(f"link_mbit={link_mbit!r} must be > 0 (Mbit/s)")
        self.pairs = {}
        for key, mbit in (pair_mbit or {}).items():
            i, j = key
            if not (isinstance(i, int) and isinstance(j, int) and 0 <= i < nodes
                    and 0 <= j < nodes and i != j):
                raise ValueError(f"pair_mbit key {key!r}: two different nodes of 0..{nodes - 1}")
            if not mbit > 0:
                raise ValueError(f"pair_mbit[{key!r}]={mbit!r} must be > 0 (Mbit/s)")
            self.pairs[frozenset((i, j))] = float(mbit)
        why = available()
        if why is not None:
            raise ClusterUnavailable(why)
        self.nodes, self.link_mbit = nodes, float(link_mbit)
        self.tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.made: list[str] = []  # namespaces, in the order made (removed in reverse)
        self.procs: list[subprocess.Popen] = []
        self.agent_logs: str | None = None  # torchrun's --log-dir for the agents (temporary)

    # -- names -----------------------------------------------------------------------------
    def namespace(self, node: int) -> str:
        return f"{self.tag}-node{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def interface(self, node: int) -> str:
        """The node's end of its link (what GLOO_SOCKET_IFNAME names inside it)."""
        return f"n{node}"

    # -- making and removing -----------------------------------------------------------------
    def up(self) -> "Cluster":
        _LIVE.append(self)
        try:
            switch = self._namespace(f"{self.tag}-switch")
            _ip("ip", "link", "add", "br0", "type", "bridge", ns=switch)
            _ip("ip", "link", "set", "br0", "up", ns=switch)
            for i in range(self.nodes):
                self._node(i, switch)
        except BaseException:
            self.down()
            raise
        return self

    def _namespace(self, name: str) -> str:
        _ip("ip", "netns", "add", name)
        self.made.append(name)
        _ip("ip", "link", "set", "lo", "up", ns=name)
        return name

    def _node(self, i: int, switch: str) -> None:
        ns, dev, port = self._namespace(self.namespace(i)), self.interface(i), f"s{i}"
        _ip("ip", "link", "add", dev, "type", "veth", "peer", "name", port, ns=switch)
        _ip("ip", "link", "set", dev, "netns", ns, ns=switch)
        _ip("ip", "link", "set", port, "master", "br0", "up", ns=switch)
        for key in ("all", "default", "lo"):  # 127.x may leave the node only with this
            _ip("sysctl", "-qw", f"net.ipv4.conf.{key}.route_localnet=1", ns=ns)
        # 127.0.0.1 stays local (its own route); the rest of 127/8 no longer is, so the
        # subnet's connected route sends it over the link
        _ip("ip", "route", "del", "local", "127.0.0.0/8", "dev", "lo", "table", "local", ns=ns)
        _ip("ip", "addr", "add", f"{self.address(i)}/24", "dev", dev, ns=ns)
        _ip("ip", "link", "set", dev, "up", ns=ns)
        _ip("sysctl", "-qw", f"net.ipv4.conf.{dev}.route_localnet=1", ns=ns)
        # both directions of the link: node i's end shapes what it sends (matched by the
        # destination), the switch's port what it delivers to node i (matched by the source)
        for where, link, match in ((ns, dev, "dst"), (switch, port, "src")):
            peers = {j: self.pairs[frozenset((i, j))] for j in range(self.nodes)
                     if frozenset((i, j)) in self.pairs}
            if not peers:
                _ip("tc", "qdisc", "add", "dev", link, "root", "tbf", "rate",
                    f"{self.link_mbit}mbit", "burst", "64kb", "latency", "400ms", ns=where)
                continue
            _ip("tc", "qdisc", "add", "dev", link, "root", "handle", "1:", "htb", "default",
                "1", ns=where)
            _ip("tc", "class", "add", "dev", link, "parent", "1:", "classid", "1:1", "htb",
                "rate", f"{self.link_mbit}mbit", "burst", "64kb", ns=where)
            for j, mbit in peers.items():
                _ip("tc", "class", "add", "dev", link, "parent", "1:", "classid",
                    f"1:{10 + j}", "htb", "rate", f"{mbit}mbit", "burst", "64kb", ns=where)
                _ip("tc", "filter", "add", "dev", link, "parent", "1:", "protocol", "ip",
                    "prio", "1", "u32", "match", "ip", match, f"{self.address(j)}/32",
                    "flowid", f"1:{10 + j}", ns=where)

    def down(self) -> None:
        """End every process inside the nodes (those started here and their children, such as
        the ranks of a torchrun agent that was killed), then remove every namespace made
        (their links go with them). Safe to call twice."""
        for name in self.made:
            _end_processes_in(name)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        self.procs.clear()
        for name in reversed(self.made):
            _ip("ip", "netns", "del", name, check=False)
        self.made.clear()
        if self.agent_logs is not None:
            shutil.rmtree(self.agent_logs, ignore_errors=True)
            self.agent_logs = None
        if self in _LIVE:
            _LIVE.remove(self)

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- running -----------------------------------------------------------------------------
    def start(self, node: int, argv: list[str], env: dict | None = None,
              **popen) -> subprocess.Popen:
        """A process inside `node`'s namespace (ended by down() if still running)."""
        if not self.made:
            raise RuntimeError("the cluster is not up: use `with Cluster(...) as c:`")
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node}: this cluster has nodes 0 to {self.nodes - 1}")
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(node)] + list(argv),
                                env={**os.environ, **(env or {})}, **popen)
        self.procs.append(proc)
        return proc

    def torchrun(self, nproc_per_node: int, argv: list[str], port: int = 29400,
                 env: dict | None = None, outputs: list | None = None,
                 join_timeout_s: float | None = None, nodes=None, max_restarts: int = 0,
                 min_nodes: int | None = None, **popen) -> list[subprocess.Popen]:
        """One torchrun agent per node, as on a real cluster: c10d rendezvous at node 0's
        address, each agent on its node's address, gloo on its node's link; argv follows
        torchrun's options (a script, or "-m", "distlab", ...). outputs: a file per node for
        its agent's stdout and stderr. join_timeout_s: how long an agent waits for every node
        to join (torchrun's own default is 600 s). nodes: start agents on these nodes only
        (the others never join; or, after kill_node, a replacement joins the job again).
        max_restarts, min_nodes: torchrun's --max-restarts and --nnodes min:max (elastic: an
        agent whose ranks failed restarts them and waits in a new rendezvous round for at
        least min_nodes nodes). Returns the agents."""
        if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
            raise ValueError(f"nproc_per_node={nproc_per_node!r} must be an int >= 1")
        if min_nodes is not None and not 1 <= min_nodes <= self.nodes:
            raise ValueError(f"min_nodes={min_nodes!r}: between 1 and the {self.nodes} nodes")
        agents = []
        conf = [] if join_timeout_s is None else [f"join_timeout={max(1, round(join_timeout_s))}"]
        elastic = {}
        if max_restarts:
            # A dead node leaves the rendezvous after 2 missed 1 s heartbeats, not torch's
            # 3 x 5 s: the restarted round starts when the replacement joins (measured here:
            # 6 s from the failure to the resumed step, 19 s with torch's defaults).
            conf.append("keep_alive_interval=1,keep_alive_max_attempt=2")
            # torch's shared rendezvous store lets no fresh agent into a later round: its
            # rank 0 keeps round 0's MASTER_ADDR, the replacement waits for the round's own
            # (both agents waited 60 s and failed, torch 2.13). Each round publishes its own.
            elastic = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        nnodes = str(self.nodes) if min_nodes is None else f"{min_nodes}:{self.nodes}"
        for i in (range(self.nodes) if nodes is None else nodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes,
                   "--nproc-per-node", str(nproc_per_node), "--max-restarts", str(max_restarts),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.address(0)}:{port}",
                   "--rdzv-id", self.tag, "--local-addr", self.address(i),
                   # torchrun makes a log folder per agent, by default a torchelastic_* one
                   # in the system's temp that nothing removes: here, one that down() does
                   "--log-dir", os.path.join(self._agent_logs(), f"node{i}")]
            cmd += (["--rdzv-conf", ",".join(conf)] if conf else []) + list(argv)
            node_env = {"GLOO_SOCKET_IFNAME": self.interface(i), "OMP_NUM_THREADS": "1",
                        **elastic, **(env or {})}
            if outputs is not None:
                popen = {**popen, "stdout": outputs[i], "stderr": subprocess.STDOUT}
            agents.append(self.start(i, cmd, env=node_env, **popen))
        return agents

    def _agent_logs(self) -> str:
        if self.agent_logs is None:
            self.agent_logs = tempfile.mkdtemp(prefix=f"{self.tag}-agents-")
        return self.agent_logs

    def kill_node(self, node: int) -> None:
        """The node fails: every process inside it is killed (SIGKILL), its agent and ranks
        alike; its namespace and link stay (down() removes them)."""
        _end_processes_in(self.namespace(node))

    def link_down(self, node: int) -> None:
        """The node's link fails: its interface goes down, nothing crosses it (the processes
        live on; collectives across it wait until their timeout)."""
        _ip("ip", "link", "set", self.interface(node), "down", ns=self.namespace(node))

    def link_is_up(self, node: int) -> bool:
        """Whether the node's link interface is up (its operational state)."""
        out = _ip("ip", "-j", "link", "show", self.interface(node), ns=self.namespace(node)).stdout
        return json.loads(out)[0].get("operstate") != "DOWN"

    def link_bytes(self, node: int) -> dict:
        """Bytes the node's link carried (its interface's own counters): {"sent", "received"}."""
        out = _ip("ip", "-s", "-j", "link", "show", self.interface(node),
                  ns=self.namespace(node)).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"sent": stats["tx"]["bytes"], "received": stats["rx"]["bytes"]}


def processes_in(namespace: str) -> list[int]:
    """Ids of the processes inside a namespace (`ip netns pids`)."""
    out = _ip("ip", "netns", "pids", namespace, check=False).stdout
    return [int(p) for p in out.split()]


def _end_processes_in(namespace: str) -> None:
    """SIGKILL what runs inside a namespace this module made (every process there was started
    by it, or by one it started), and wait until none is left (at most 10 s)."""
    deadline = time.monotonic() + 10
    while (pids := processes_in(namespace)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


@atexit.register
def _down_all() -> None:
    for cluster in list(_LIVE):
        cluster.down()


def clean_leftovers() -> list[str]:
    """Remove the namespaces of clusters whose creating process is gone (a killed kernel);
    returns their names. Namespaces of live processes are left alone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        m = re.fullmatch(rf"{PREFIX}(\d+)-\d+-(switch|node\d+)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _end_processes_in(name)
            _ip("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


if __name__ == "__main__":
    if sys.argv[1:] == ["--clean"]:
        gone = clean_leftovers()
        print(f"removed {len(gone)} namespace(s) left by ended processes"
              + (": " + ", ".join(gone) if gone else ""))
    else:
        print("usage: python -m distlab.caller.cluster --clean")
