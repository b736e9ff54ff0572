"""The routers of today's MoE models, measured on real ranks (15's sections 6-8 and
benchmarks/expert_routing.py): balance with and without an auxiliary loss, dropless against a
capacity, and what each costs.

Balance. Every run is `ep` on the same data, seed and steps, dropless (capacity_factor 0) so
that no token dropped hides the load or the loss; only the balancing differs:

    none          no auxiliary loss, no bias
    Switch c      Switch's loss E x sum f_i P_i at coefficient c (Fedus et al. 2021)
    bias u        DeepSeek-V3's auxiliary-loss-free bias at rate u (Wang et al. 2024)

The load is MaxVio per step (Wang et al. 2024: the busiest expert's tokens over the mean,
minus 1), from the tokens each rank routed to each expert (the step events' "moe"), summed over
the ranks, averaged over the blocks. The quality is the language model's cross-entropy alone:
the step's loss minus coefficient x each block's auxiliary loss (both logged by the step), so
the Switch runs are not charged their own balance term.

Dropless against a capacity. Per step and rank: the rows the dispatch sent (bytes booked under
ep.dispatch) and the activations the step saved for backward; their mean and their worst over
the run. A capacity bounds them (at most E x C rows reach the experts of a group, whatever the
router does: the "static shapes" a fixed-size dispatch relies on); dropless bounds them only by
tokens x k, every choice to a remote expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from distlab.config import RunConfig
from distlab.lab.experts import LEGEND, dispatch_bytes, dropped_fraction, global_loads
from distlab.lab.runs import launch_together
from distlab.models.moe import max_violation


def balance_configs(base: RunConfig, coefs=(1e-3, 1e-2, 1e-1), rates=(1e-3, 1e-2)) -> dict:
    """The runs of the balance comparison, by name: `base` (an ep config) made dropless, with
    no balancing, Switch's loss at each coefficient, and the bias at each rate."""
    plain = base.replace(capacity_factor=0.0, aux_loss_coef=0.0, expert_bias_rate=0.0)
    runs = {"none": plain}
    runs.update({f"Switch {c:g}": plain.replace(aux_loss_coef=c) for c in coefs})
    runs.update({f"bias {u:g}": plain.replace(expert_bias_rate=u) for u in rates})
    return runs


def max_vio_per_step(run) -> list[float]:
    """MaxVio of each step, the mean over the blocks of each block's global load."""
    return [sum(max_violation(b) for b in blocks) / len(blocks)
            for blocks in global_loads(run).values()]


def lm_loss_per_step(run) -> list[float]:
    """The cross-entropy of each step (mean over the ranks): the loss minus the auxiliary
    term the step added (its coefficient x each block's auxiliary loss, as logged)."""
    coef = run.cfg.aux_loss_coef
    by_step: dict[int, list[float]] = {}
    for e in run.history("step"):
        aux = sum(m["aux_loss"] for m in e.get("moe") or [])
        by_step.setdefault(e["step"], []).append(e["loss"] - coef * aux)
    return [sum(v) / len(v) for _, v in sorted(by_step.items())]


def tail_mean(values: list[float], fraction: float = 0.5) -> float:
    """The mean of the last `fraction` of the values (the run once the router has settled)."""
    tail = values[-max(1, round(len(values) * fraction)):]
    return sum(tail) / len(tail)


def balance_rows(runs: dict) -> list[dict]:
    """Per run: MaxVio over the second half of the steps, the final one, and the LM loss over
    the last quarter."""
    rows = []
    for name, run in runs.items():
        vio, lm = max_vio_per_step(run), lm_loss_per_step(run)
        rows.append({"name": name, "max_vio": tail_mean(vio), "max_vio_last": vio[-1],
                     "lm_loss": tail_mean(lm, 0.25), "aux_loss_coef": run.cfg.aux_loss_coef,
                     "bias_rate": run.cfg.expert_bias_rate})
    return rows


def balance_figure(runs: dict, window: int = 10):
    """MaxVio step by step, one line per run, each point the mean of the last `window` steps
    (one step's MaxVio swings with its 128 tokens' draw; the mean shows the trend)."""
    fig = go.Figure()
    for name, run in runs.items():
        vio = max_vio_per_step(run)
        mean = [sum(vio[max(0, i - window + 1):i + 1]) / len(vio[max(0, i - window + 1):i + 1])
                for i in range(len(vio))]
        fig.add_scatter(x=list(range(len(vio))), y=mean, mode="lines", name=name)
    fig.update_layout(height=360, template="plotly_white", legend=LEGEND,
                      title=f"MaxVio (the busiest expert over the mean, minus 1), mean of the "
                            f"last {window} steps",
                      xaxis_title="step", yaxis_title="MaxVio, mean over blocks",
                      yaxis_rangemode="tozero")
    return fig


def run_balance(base: RunConfig, coefs=(1e-3, 1e-2, 1e-1), rates=(1e-3, 1e-2)) -> dict:
    """Every balance run in one launch: {name: Run}."""
    return launch_together(balance_configs(base, coefs, rates), name="ep-balance-routers")


@dataclass
class BalanceStudy:
    """The balance runs over several seeds (the repeats): runs[seed][name] and
    rows[seed][name] (balance_rows)."""
    runs: dict
    rows: dict

    @property
    def seeds(self) -> list:
        return list(self.rows)

    @property
    def names(self) -> list:
        return list(self.rows[self.seeds[0]])

    def max_vio(self, name: str) -> list[float]:
        return [self.rows[s][name]["max_vio"] for s in self.seeds]

    def best_switch(self, seed) -> str:
        """The Switch coefficient that balanced best in this seed (lowest MaxVio)."""
        return min((n for n in self.names if n.startswith("Switch")),
                   key=lambda n: self.rows[seed][n]["max_vio"])

    def lm_cost(self, bias: str) -> list[float]:
        """Per seed: the LM loss of Switch's best-balancing run minus the bias run's."""
        return [self.rows[s][self.best_switch(s)]["lm_loss"] - self.rows[s][bias]["lm_loss"]
                for s in self.seeds]

    def table(self):
        from distlab.lab.common import table
        table(["run"] + [f"MaxVio, seed {s}" for s in self.seeds]
              + [f"LM loss, seed {s}" for s in self.seeds],
              [[n] + [f"{self.rows[s][n]['max_vio']:.3f}" for s in self.seeds]
               + [f"{self.rows[s][n]['lm_loss']:.4f}" for s in self.seeds]
               for n in self.names])


def balance_study(base: RunConfig, seeds, coefs=(1e-3, 1e-2, 1e-1),
                  rates=(1e-3, 1e-2)) -> BalanceStudy:
    """run_balance once per seed (one launch each)."""
    runs = {seed: run_balance(base.replace(seed=seed), coefs, rates) for seed in seeds}
    return BalanceStudy(runs, {seed: {r["name"]: r for r in balance_rows(rs)}
                               for seed, rs in runs.items()})


# -- dropless against a capacity ---------------------------------------------------------------
def per_step(run, read) -> list[float]:
    """read(event) for every step event of every rank (a rank's step is one sample)."""
    return [read(e) for e in run.history("step")]


def traffic_rows(runs: dict) -> list[dict]:
    """Per run: choices dropped, dispatch bytes per rank per step and activations per rank per
    step, each as mean and worst over the run."""
    rows = []
    for name, run in runs.items():
        sent = per_step(run, lambda e: e["comm"].get("ep.dispatch", {}).get("bytes_sent", 0))
        acts = per_step(run, lambda e: e["memory"]["activations"])
        rows.append({"name": name, "capacity_factor": run.cfg.capacity_factor,
                     "dropped": dropped_fraction(run), "sent_mean": dispatch_bytes(run),
                     "sent_max": max(sent), "acts_mean": sum(acts) / len(acts),
                     "acts_max": max(acts)})
    return rows


@dataclass
class TrafficStudy:
    """The capacity runs and a dropless one: cfgs[name], runs[name], rows[name]
    (traffic_rows)."""
    cfgs: dict
    runs: dict
    rows: dict

    @property
    def row_bytes(self) -> int:  # one token's row, float32
        return next(iter(self.cfgs.values())).n_embd * 4

    def bound(self, name: str) -> int:
        return dispatch_bound(self.cfgs[name], self.row_bytes)

    def capacity_rows(self) -> list[dict]:
        """The capacity runs as capacity_figure's rows (dropless left out: no factor)."""
        from distlab.theory.context_and_experts import expert_capacity
        out = []
        for name, cfg in self.cfgs.items():
            if cfg.capacity_factor:
                r = self.rows[name]
                out.append({"capacity_factor": cfg.capacity_factor,
                            "capacity": expert_capacity(cfg.micro_batch * cfg.seq_len,
                                                        cfg.n_experts, cfg.capacity_factor,
                                                        cfg.top_k),
                            "dropped": r["dropped"], "dispatch_bytes": r["sent_mean"],
                            "activations": r["acts_mean"]})
        return out

    def table(self):
        from distlab.lab.common import fmt_bytes, table
        from distlab.theory.context_and_experts import expert_capacity
        cfg0 = next(iter(self.cfgs.values()))
        tokens = cfg0.micro_batch * cfg0.seq_len
        table(["run", f"capacity per expert ({tokens} tokens, {cfg0.n_experts} experts)",
               "choices dropped", "dispatch per rank per step: mean / worst / ceiling",
               "activations per rank per step: mean / worst"],
              [[name, expert_capacity(tokens, cfg.n_experts, cfg.capacity_factor, cfg.top_k)
                if cfg.capacity_factor else "none", f"{100 * r['dropped']:.1f}%",
                f"{fmt_bytes(r['sent_mean'])} / {fmt_bytes(r['sent_max'])} / "
                f"{fmt_bytes(self.bound(name))}",
                f"{fmt_bytes(r['acts_mean'])} / {fmt_bytes(r['acts_max'])}"]
               for name, cfg, r in ((n, c, self.rows[n]) for n, c in self.cfgs.items())])


def traffic_study(base: RunConfig, factors, steps: int) -> TrafficStudy:
    """One launch: `base` at each capacity factor ("cf F") and dropless."""
    cfgs = {f"cf {cf}": base.replace(capacity_factor=cf, steps=steps) for cf in factors}
    cfgs["dropless"] = base.replace(capacity_factor=0.0, steps=steps)
    runs = launch_together(cfgs, name="ep-capacity")
    return TrafficStudy(cfgs, runs, {r["name"]: r for r in traffic_rows(runs)})


def dispatch_bound(cfg: RunConfig, row_bytes: int) -> int:
    """The most bytes one rank's dispatch can send in a step under cfg's router, summed over
    the blocks (theory.context_and_experts.ep_dispatch_ceiling)."""
    from distlab.theory.context_and_experts import ep_dispatch_ceiling
    return cfg.n_layer * ep_dispatch_ceiling(cfg.micro_batch * cfg.seq_len, cfg.n_experts,
                                             cfg.world_size, cfg.top_k, cfg.capacity_factor,
                                             row_bytes)
