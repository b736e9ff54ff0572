"""A node dies mid-run and a replacement joins: torchrun's elastic restart across simulated nodes
(distlab.caller.cluster: root only).

The same training runs twice, each as one torchrun agent per node (`--max-restarts 1`,
`--nnodes min:max` with min one node fewer), checkpointing every cfg.checkpoint_every steps and
resuming from the newest checkpoint that verifies (resume_from="auto"):

    uninterrupted   every node to the end
    node killed     once rank 0 has logged `kill_after` steps, every process of node `victim`
                    (agent and ranks) is SIGKILLed, as when a machine fails; `gap_s` later a new
                    agent starts on that node, as a scheduler replaces a machine

In the second, the surviving ranks fail in their next collective (gloo: connection closed by
the peer), their agent restarts them into a new rendezvous round, the replacement joins it, and
every rank loads the checkpoint and trains on. The steps since that checkpoint run twice. The
claim under test: every step's loss equals the uninterrupted run's, bit for bit (the
checkpoint holds the model, the optimizer, the RNGs, and the data position is the step).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass

from distlab.caller.cluster import Cluster, processes_in
from distlab.caller.flags import cli_args
from distlab.caller.run import Run


@dataclass
class NodeFault:
    uninterrupted: dict  # step -> loss
    recovered: dict  # step -> loss, the last run of each step (the resumed one)
    first_try: dict  # step -> loss of the steps that ran twice, before the node died
    killed_after_step: int  # the last step rank 0 had logged when the node was killed
    resumed_from: int  # steps done in the checkpoint the restarted ranks loaded
    kill_to_resumed_s: float  # from the kill to the restarted ranks' first step
    seconds: tuple  # wall-clock of (uninterrupted, node killed)
    exit_codes: list  # the agents': node 0..N-1, then the replacement
    left: list  # processes still in a node's namespace after the agents exited

    @property
    def rerun(self) -> list[int]:
        return sorted(self.first_try)

    @property
    def rerun_identical(self) -> bool:
        """Each step run twice logged the same loss, bit for bit, both times."""
        return bool(self.first_try) and all(self.first_try[s] == self.recovered[s]
                                            for s in self.first_try)

    @property
    def identical(self) -> bool:
        """Every step's loss equals the uninterrupted run's, and so do the re-run steps'."""
        return (bool(self.uninterrupted) and self.recovered == self.uninterrupted
                and all(self.first_try[s] == self.uninterrupted[s] for s in self.first_try))


def node_fault(cfg, kill_after: int, folder: str, victim: int = 1, gap_s: float = 1.0,
               timeout_s: float = 300, uninterrupted: bool = True) -> NodeFault:
    """Run cfg (cfg.nodes simulated nodes, cfg.world_size ranks) uninterrupted and then with
    node `victim` killed after `kill_after` steps; both runs' folders under `folder`.
    uninterrupted=False: the second run alone (a cheaper test: the steps run twice are
    compared with their first tries, the rest with nothing)."""
    if cfg.nodes < 2:
        raise ValueError(f"nodes={cfg.nodes}: a node fault needs at least 2 nodes")
    if not 0 < victim < cfg.nodes:  # node 0 hosts the rendezvous, as on a real cluster
        raise ValueError(f"victim={victim}: one of nodes 1..{cfg.nodes - 1} (node 0 hosts the "
                         "rendezvous)")
    if not 0 < cfg.checkpoint_every < kill_after < cfg.steps - 1:
        raise ValueError(f"kill_after={kill_after}: after the first checkpoint (checkpoint_every="
                         f"{cfg.checkpoint_every}) and before the last step ({cfg.steps - 1})")
    cfg = cfg.replace(resume_from="auto")
    plain = (_run(cfg, os.path.join(folder, "uninterrupted"), None, timeout_s)
             if uninterrupted else {"dir": None, "left": [], "seconds": 0.0})
    hit = _run(cfg, os.path.join(folder, "node-killed"), (victim, kill_after, gap_s), timeout_s)
    steps = Run.load(hit["dir"]).history("step", rank=0)
    first, recovered = {}, {}
    for e in steps:
        if e["step"] in recovered and e["step"] not in first:
            first[e["step"]] = recovered[e["step"]]
        recovered[e["step"]] = e["loss"]
    resume = Run.load(hit["dir"]).history("resume", rank=0)
    resumed_first = next((e["time"] for e in steps if e["time"] > hit["killed_at"]), None)
    return NodeFault(
        uninterrupted=({e["step"]: e["loss"] for e in Run.load(plain["dir"]).history("step",
                                                                                    rank=0)}
                       if uninterrupted else {}),
        recovered=recovered, first_try=first, killed_after_step=hit["killed_after_step"],
        resumed_from=resume[-1]["steps_done"] if resume else 0,
        kill_to_resumed_s=(resumed_first - hit["killed_at"]) if resumed_first else float("nan"),
        seconds=(plain["seconds"], hit["seconds"]), exit_codes=hit["codes"],
        left=plain["left"] + hit["left"])


def _run(cfg, run_dir: str, kill, timeout_s: float) -> dict:
    """One torchrun job across cfg.nodes simulated nodes; kill = (victim, after, gap_s)."""
    os.makedirs(run_dir, exist_ok=True)
    argv = ["-m", "distlab", *cli_args(cfg.replace(checkpoint_dir=os.path.join(run_dir, "ckpt"))),
            "--run-dir", run_dir, "--log-every", "0"]
    per_node = cfg.world_size // cfg.nodes
    elastic = {"max_restarts": 1, "min_nodes": cfg.nodes - 1}
    logs = [open(os.path.join(run_dir, f"node{i}.log"), "w") for i in range(cfg.nodes)]
    out = {"dir": run_dir, "killed_at": None, "killed_after_step": None}
    t0 = time.monotonic()
    try:
        with Cluster(cfg.nodes, cfg.link_mbit) as cluster:
            agents = cluster.torchrun(per_node, argv, outputs=logs, **elastic)
            if kill is not None:
                victim, after, gap_s = kill
                out["killed_after_step"] = _wait_for_step(run_dir, after, agents, t0 + timeout_s)
                cluster.kill_node(victim)
                out["killed_at"] = time.time()
                time.sleep(gap_s)
                logs.append(open(os.path.join(run_dir, f"node{victim}-replacement.log"), "w"))
                slots = [None] * cfg.nodes
                slots[victim] = logs[-1]
                agents += cluster.torchrun(per_node, argv, outputs=slots, nodes=[victim],
                                           **elastic)
            for a in agents:
                a.wait(timeout=max(1.0, t0 + timeout_s - time.monotonic()))
            out["left"] = [p for i in range(cfg.nodes) for p in processes_in(cluster.namespace(i))]
    except subprocess.TimeoutExpired as e:
        raise TimeoutError(f"the run in {run_dir} did not end within {timeout_s} s (its nodes "
                           "were removed; node<i>.log there has each agent's output)") from e
    finally:
        for f in logs:
            f.close()
    out["codes"] = [a.returncode for a in agents]
    out["seconds"] = time.monotonic() - t0
    return out


def _wait_for_step(run_dir: str, step: int, agents, deadline: float) -> int:
    """The last step rank 0 has logged, once it is at least `step`."""
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(run_dir, "rank0.jsonl")):
            done = Run.load(run_dir).history("step", rank=0)
            if done and done[-1]["step"] >= step:
                return done[-1]["step"]
        if any(a.poll() is not None for a in agents):
            raise RuntimeError(f"an agent ended before step {step} (node<i>.log in {run_dir})")
        time.sleep(0.05)
    raise TimeoutError(f"rank 0 did not reach step {step} in time ({run_dir})")
