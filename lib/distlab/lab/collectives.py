"""Rank-side demo programs for the collectives notebook (01_collectives), and the few caller-side
helpers that turn their per-rank results into tables and fits.

Each rank program has the signature `fn(rank, world, device, log, ...)` and returns plain data
(lists, dicts, numbers, strings), so `distlab.run_ranks(fn, world, ...)` can bring it back:

    before_after = distlab.run_ranks(show_collectives, 4)
    rows = distlab.run_ranks(compare_allreduce, 4, [1024, 2**20], 5)
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from distlab import wire
from distlab.comm import (
    Comm,
    Link,
    naive_allreduce_bytes,
    naive_allreduce_time,
    ring_allreduce_bytes,
    ring_allreduce_time,
)
from distlab.units import KiB, MiB

ALGORITHMS = ("torch", "ring", "naive")
KIND = {"torch": "all_reduce", "ring": "all_reduce.ring", "naive": "all_reduce.naive"}


def _ints(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.tolist()]


def show_collectives(rank, world, device, log):
    """What each rank holds before and after the five collectives.

    Rank r starts with x_r = (r+1)·[1, 10, 100, ...] (world entries, integer-valued float64,
    so every sum is exact and readable):

    * all-reduce (sum): every rank ends with Σ_r x_r.
    * broadcast from rank 0: every rank ends with x_0.
    * all-gather: every rank ends with x_0 ‖ x_1 ‖ ... (rank order).
    * reduce-scatter (sum): rank r ends with entry r of Σ_r x_r, its 1/world block of the
      all-reduce. Reduce-scatter followed by all-gather is an all-reduce; the ring does exactly that.
    * all-to-all: entry j of rank r goes to rank j, so rank r ends with entry r of every x_s
      (a transpose across the ranks: expert parallelism's dispatch, Ulysses' head split).

    Also returns who the rank is (rank, world, backend, device, pid, environment) and the bytes
    Comm booked per collective.
    """
    comm = Comm()
    x = (rank + 1) * 10.0 ** torch.arange(world, dtype=torch.float64, device=device)
    out = {}
    t = x.clone()
    out["all_reduce"] = {"before": _ints(x), "after": _ints(comm.all_reduce(t))}
    t = x.clone()
    out["broadcast"] = {"before": _ints(x), "after": _ints(comm.broadcast(t, src=0))}
    g = torch.empty(world * world, dtype=x.dtype, device=device)
    out["all_gather"] = {"before": _ints(x), "after": _ints(comm.all_gather(g, x))}
    rs = torch.empty(1, dtype=x.dtype, device=device)
    out["reduce_scatter"] = {"before": _ints(x), "after": _ints(comm.reduce_scatter(rs, x))}
    a2a = torch.empty(world, dtype=x.dtype, device=device)
    out["all_to_all"] = {"before": _ints(x), "after": _ints(comm.all_to_all(a2a, x))}
    whoami = {"rank": dist.get_rank(), "world": dist.get_world_size(),
              "backend": dist.get_backend(), "device": str(device), "pid": os.getpid(),
              "threads": torch.get_num_threads(),
              "env": {k: os.environ.get(k, "") for k in
                      ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}}
    return {"collectives": out, "whoami": whoami, "comm": comm.snapshot()}


def compare_allreduce(rank, world, device, log, sizes_bytes, repeats):
    """Our ring and naive all-reduce against torch's own dist.all_reduce, size by size.

    For every size S (bytes of float32) and algorithm (torch | ring | naive, all through Comm):

    * correctness: max |result - dist.all_reduce(same input)| on random normal data (seeded per
      rank; sums in a different order differ by rounding only), and an exact equality check on
      integer-valued floats (small integers sum exactly in any order);
    * bytes this rank sent and received in one call, from Comm's stats (counted for ring and
      naive, modeled for torch: see distlab.comm);
    * the seconds of `repeats` calls (an int, or {size: calls}), each after a barrier so all
      ranks start together; the
      algorithms take turns (repeat i starts with the i-th, rotating), so a load that comes or
      goes during the comparison falls on all three alike.

    Returns one dict per (size, algorithm) for this rank.
    """
    rows = []
    for S in sizes_bytes:
        n = S // 4
        gen = torch.Generator().manual_seed(1000 * (rank + 1) + n)
        x = torch.randn(n, generator=gen).to(device)
        xi = torch.randint(-1000, 1000, (n,), generator=gen, dtype=torch.float32).to(device)
        ref, refi = x.clone(), xi.clone()
        dist.all_reduce(ref)  # the reference: torch's own collective, not through Comm
        dist.all_reduce(refi)
        comms, times, cells = {}, {}, []
        for algo in ALGORITHMS:
            comm = comms[algo] = Comm()
            diff = float((comm.all_reduce(x.clone(), algorithm=algo) - ref).abs().max())
            one_call = comm.snapshot()[KIND[algo]]  # the bytes of exactly one call
            exact = torch.equal(comm.all_reduce(xi.clone(), algorithm=algo), refi)
            times[algo] = []
            cells.append({"rank": rank, "world": world, "size_bytes": S, "algorithm": algo,
                          "max_abs_diff": diff, "exact_int": bool(exact),
                          "bytes_sent": one_call["bytes_sent"],
                          "bytes_recv": one_call["bytes_recv"], "times_s": times[algo]})
        y = torch.empty_like(x)
        for i in range(repeats[S] if isinstance(repeats, dict) else repeats):
            for algo in ALGORITHMS[i % len(ALGORITHMS):] + ALGORITHMS[:i % len(ALGORITHMS)]:
                y.copy_(x)
                dist.barrier()
                t0 = time.perf_counter()
                comms[algo].all_reduce(y, algorithm=algo)
                times[algo].append(time.perf_counter() - t0)
        rows += [{**c, "median_s": statistics.median(c["times_s"])} for c in cells]
    return rows


WIRE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
              "all_reduce.ring", "all_reduce.naive")


def compare_then_wire(rank, world, device, log, sizes_bytes, repeats, wire_nbytes):
    """compare_allreduce, then wire_per_collective, in the same ranks: one launch for 01's
    section 3, its timings then its bytes on the wire (a launch of 4 ranks costs seconds of this machine's 2 cores)."""
    return {"compare": compare_allreduce(rank, world, device, log, sizes_bytes, repeats),
            "wire": wire_per_collective(rank, world, device, log, wire_nbytes)}


def wire_per_collective(rank, world, device, log, nbytes):
    """One call of each collective on `nbytes` of float32, alone (a barrier before each), and
    per kind the bytes Comm booked beside the bytes the kernel saw this rank write during the
    call (distlab.wire). all_gather gathers nbytes/world from each rank, so every kind's
    result is `nbytes` long; reduce_scatter reduces `nbytes` into nbytes/world."""
    n = nbytes // 4
    x = torch.ones(n, device=device)
    calls = {
        "all_reduce": lambda c: c.all_reduce(x.clone()),
        "all_gather": lambda c: c.all_gather(torch.empty(n, device=device), x[: n // world]),
        "reduce_scatter": lambda c: c.reduce_scatter(torch.empty(n // world, device=device), x),
        "broadcast": lambda c: c.broadcast(x.clone(), src=0),
        "all_to_all": lambda c: c.all_to_all(torch.empty(n, device=device), x),
        "all_reduce.ring": lambda c: c.all_reduce(x.clone(), algorithm="ring"),
        "all_reduce.naive": lambda c: c.all_reduce(x.clone(), algorithm="naive"),
    }
    out = {"rank": rank, "world": world, "nbytes": nbytes,
           "wire_blind": wire.visible(dist.get_backend())}
    for kind in WIRE_KINDS:
        comm = Comm()
        dist.barrier()
        calls[kind](comm)
        st = comm.snapshot()[kind]
        out[kind] = {"booked": st["bytes_sent"], "wire": st["wire_sent"]}
    return out


def wire_rows(results) -> list[dict]:
    """wire_per_collective's per-rank results as one row per (kind, rank): booked bytes, wire
    bytes, and wire / booked (None where the kernel's counter cannot see the traffic)."""
    rows = []
    for kind in WIRE_KINDS:
        for r in sorted(results, key=lambda r: r["rank"]):
            b, w = r[kind]["booked"], r[kind]["wire"]
            rows.append({"kind": kind, "rank": r["rank"], "world": r["world"], "booked": b,
                         "wire": w, "ratio": (w / b if b and w is not None else None)})
    return rows


def wire_by_kind(rows, S) -> dict:
    """Per collective: each rank's booked and wire bytes in units of S, the largest
    |wire / booked - 1| over the ranks ("off"), and whether the formula holds on the wire
    within `WIRE_TOL` on every rank (a rank that books nothing must write
    under 1% of S: a header or an acknowledgement, no payload)."""
    out = {}
    for r in rows:
        k = out.setdefault(r["kind"], {"booked": [], "wire": [], "holds": True, "off": 0.0})
        k["booked"].append(r["booked"] / S)
        k["wire"].append(r["wire"] / S)
        if r["booked"]:  # how far the wire is from the formula, the worst rank
            k["off"] = max(k["off"], abs(r["ratio"] - 1))
        ok = (abs(r["ratio"] - 1) <= WIRE_TOL if r["booked"] else r["wire"] < 0.01 * S)
        k["holds"] = k["holds"] and ok
    return out


WIRE_TOL = 0.02  # gloo's 48-byte message headers are 0.03% of a 4 MiB payload


# -- caller side: from per-rank rows to tables and fits -------------------------------------------
def summarize(results) -> list[dict]:
    """Merge compare_allreduce's per-rank rows (run_ranks' list) into one row per (size,
    algorithm): the worst diff over ranks, exactness on every rank, the bytes per rank (rank
    order), the time of the collective = the slowest rank's median, and "samples": per repeat,
    the slowest rank's time (the repeats a timed claim reads)."""
    by = {}
    for rows in results:
        for r in rows:
            by.setdefault((r["size_bytes"], ALGORITHMS.index(r["algorithm"])), []).append(r)
    out = []
    for (S, _), rs in sorted(by.items()):
        rs.sort(key=lambda r: r["rank"])
        out.append({"size_bytes": S, "algorithm": rs[0]["algorithm"], "world": rs[0]["world"],
                    "max_abs_diff": max(r["max_abs_diff"] for r in rs),
                    "exact_int": all(r["exact_int"] for r in rs),
                    "bytes_sent": [r["bytes_sent"] for r in rs],
                    "bytes_recv": [r["bytes_recv"] for r in rs],
                    "seconds": max(r["median_s"] for r in rs),
                    "samples": [max(ts) for ts in zip(*(r["times_s"] for r in rs))]})
    return out


def alpha_beta_points(summary) -> list[dict]:
    """For ring and naive rows: the messages m and bytes B in series on the busiest link, as
    distlab.comm's time models count them, so that t ≈ m·α + B/β.

    ring: 2(N-1) steps; in each a rank sends one chunk while it receives another (a full-duplex
    link), so B = the bytes one rank sent = 2(N-1)/N·S. naive: the root first receives N-1
    messages, then sends N-1, one after another, so B = root's sent + received = 2(N-1)·S.
    Both B are taken from the counted bytes, not the formula."""
    pts = []
    for r in summary:
        if r["algorithm"] == "torch":
            continue  # gloo's own algorithm: its message count is not ours to know
        n = r["world"]
        B = max(r["bytes_sent"]) if r["algorithm"] == "ring" else (
            r["bytes_sent"][0] + r["bytes_recv"][0])
        pts.append({"algorithm": r["algorithm"], "size_bytes": r["size_bytes"],
                    "messages": 2 * (n - 1), "bytes": B, "seconds": r["seconds"],
                    "samples": r["samples"]})
    return pts


def fit_loopback(summary, algorithms=("ring", "naive"),
                 factor: bool = False) -> tuple[float, float]:
    """α (s per message) and β (bytes/s) of this machine's loopback: distlab.comm.fit_alpha_beta
    over the `algorithms`' points of `summary` (least squares on seconds, or with `factor` on
    the log of model / measured, so that every size counts alike and a model 2× over a point
    costs what 2× under it does)."""
    from distlab.comm import fit_alpha_beta
    pts = [p for p in alpha_beta_points(summary) if p["algorithm"] in algorithms]
    return fit_alpha_beta([p["bytes"] for p in pts], [p["seconds"] for p in pts],
                          [p["messages"] for p in pts], factor=factor)



# -- caller side: labels, the counted ratios, figures ------------------------------------------
TIME_MODELS = {"ring": ring_allreduce_time, "naive": naive_allreduce_time}  # distlab.comm's α-β

# "≈" in the claim below, as a number: a bandwidth term within 15% of its limit. The ring's
# 2(N-1)/N·S/β is (N-1)/N of 2S/β, 0.875 of it at N = 8, the smallest N the row checks; naive's
# 2(N-1)·S/β is (N-1)/N of 2N·S/β, the same factor.
BANDWIDTH_TERM_TOL = 0.15


def _ms_or_s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def bandwidth_term_check(nbytes: float, link: Link, ns=(8, 1024), models=None,
                         tol: float = BANDWIDTH_TERM_TOL) -> dict:
    """The claim "the ring's bandwidth term stays ≈ 2S/β as N grows; naive's grows ∝ N", read
    off distlab.comm's models (`models`: {"ring": f, "naive": f}, f(S, N, link) seconds; by
    default TIME_MODELS). Each model evaluated on the link with α = 0 gives its bandwidth term
    (the formulas are not retyped here, so a model that grew otherwise would read no). At each
    N of `ns`: the ring's term within `tol` of 2S/β and naive's within `tol` of 2N·S/β.

    Returns {"holds", "figure" (the claims row's text: the terms, the bar, and the ring's total
    with its latency term beside them, which the claim leaves out), "ring_bw", "naive_bw",
    "ring_total", "ring_latency" ({N: seconds})}."""
    import dataclasses
    models = models or TIME_MODELS
    free = dataclasses.replace(link, alpha_s=0.0)  # no latency: what is left is bytes / β
    limit = 2 * nbytes / link.bandwidth_Bps
    ring_bw = {n: models["ring"](nbytes, n, free) for n in ns}
    naive_bw = {n: models["naive"](nbytes, n, free) for n in ns}
    total = {n: models["ring"](nbytes, n, link) for n in ns}
    latency = {n: total[n] - ring_bw[n] for n in ns}
    ring_ok = all(abs(ring_bw[n] / limit - 1) <= tol for n in ns)
    naive_ok = all(abs(naive_bw[n] / (n * limit) - 1) <= tol for n in ns)
    at = " / ".join(map(str, ns))
    big = max(ns)
    figure = (f"{nbytes / 1e6:g} MB, bandwidth terms (distlab.comm's models with α = 0) at "
              f"N = {at}: ring {' / '.join(_ms_or_s(ring_bw[n]) for n in ns)} against 2S/β = "
              f"{_ms_or_s(limit)}; naive {' / '.join(_ms_or_s(naive_bw[n]) for n in ns)} "
              f"against 2N·S/β = {' / '.join(_ms_or_s(n * limit) for n in ns)}; the bar: each "
              f"within {tol:.0%}. Not in the claim: the ring's total at N = {big} is "
              f"{_ms_or_s(total[big])}, {_ms_or_s(latency[big])} of it the latency term "
              "2(N−1)·α. From the link's constants alone: arithmetic, not evidence")
    return {"holds": ring_ok and naive_ok, "figure": figure, "ring_bw": ring_bw,
            "naive_bw": naive_bw, "ring_total": total, "ring_latency": latency}



def listening_addresses(port: int) -> list[str]:
    """The addresses this process listens on at `port`, as the kernel reports them (psutil)."""
    import psutil
    return sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr.port == port})


def listens_everywhere(addresses) -> bool:
    """Whether any of the addresses is the unspecified one ('::' or its IPv4 twin): a socket
    bound there accepts connections on every interface of the machine."""
    import ipaddress
    return any(ipaddress.ip_address(a).is_unspecified for a in addresses)


def size_label(nbytes: int) -> str:
    """A tensor size as the notebook names it: "4 MiB", "256 KiB" (binary units)."""
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes / KiB:g} KiB"


def counted_ratios(summary) -> dict[str, list[float]]:
    """Every distinct bytes/S ratio counted, over all sizes: the ring's (each rank, sent and
    received), the naive root's bytes sent, and the other ranks' bytes sent. One value each
    when the formula holds at every size."""
    ring = [r for r in summary if r["algorithm"] == "ring"]
    naive = [r for r in summary if r["algorithm"] == "naive"]
    return {"ring": sorted({b / r["size_bytes"] for r in ring
                            for b in r["bytes_sent"] + r["bytes_recv"]}),
            "root": sorted({r["bytes_sent"][0] / r["size_bytes"] for r in naive}),
            "other": sorted({b / r["size_bytes"] for r in naive for b in r["bytes_sent"][1:]})}


def ratio_list(ratios) -> str:
    """Ratios as the claims table shows them: "1.5" or "1, 3"."""
    return ", ".join(f"{v:g}" for v in ratios)


def bytes_per_rank_figure(ring: dict, naive: dict, S: int, n: int):
    """Bars: the bytes each rank sent in one all-reduce of S, counted, beside the formulas
    (ring 2(N-1)/N·S everywhere; naive (N-1)·S at the root, S elsewhere)."""
    import plotly.graph_objects as go
    nb = naive_allreduce_bytes(S, n)
    ranks = [f"rank {k}" for k in range(n)]
    fig = go.Figure([
        go.Bar(name="ring, counted", x=ranks, y=[b / S for b in ring["bytes_sent"]]),
        go.Bar(name="ring, 2(N-1)/N·S", x=ranks, y=[ring_allreduce_bytes(S, n) / S] * n),
        go.Bar(name="naive, counted", x=ranks, y=[b / S for b in naive["bytes_sent"]]),
        go.Bar(name="naive, (N-1)·S at root, S elsewhere", x=ranks,
               y=[nb["root_sent"] / S] + [nb["other_sent"] / S] * (n - 1)),
    ])
    fig.update_layout(barmode="group", height=380,
                      title=f"Bytes each rank sent in one all-reduce of S = {size_label(S)}, "
                            f"N = {n} (received: the same)",
                      yaxis_title="bytes sent / S")
    return fig


def wire_figure(by_kind: dict, S: int, n: int):
    """Bars per collective: the busiest rank's bytes, booked and counted on the wire."""
    import plotly.graph_objects as go
    fig = go.Figure([
        go.Bar(name="booked (formula or count)", x=list(by_kind),
               y=[max(v["booked"]) for v in by_kind.values()], marker_color="#a5d8d3"),
        go.Bar(name="on the wire (kernel)", x=list(by_kind),
               y=[max(v["wire"]) for v in by_kind.values()], marker_color="#0b7285")])
    fig.update_layout(barmode="group", height=360, yaxis_title="bytes sent / S (busiest rank)",
                      title=f"One call on S = {size_label(S)}, N = {n}: the busiest "
                            "rank's bytes, booked and on the wire")
    return fig


def allreduce_time_figure(summary, sizes, n: int, loopback: Link, repeats: int | str):
    """Log-log: all-reduce time against size, measured (each algorithm) and the α-β model
    with the loopback's fitted α and β (dotted)."""
    import plotly.graph_objects as go
    fig = go.Figure()
    for algo in ALGORITHMS:
        rows = [r for r in summary if r["algorithm"] == algo]
        fig.add_scatter(x=[r["size_bytes"] for r in rows], y=[r["seconds"] * 1e3 for r in rows],
                        mode="lines+markers", name=f"{algo}, measured")
    for algo, model in TIME_MODELS.items():
        fig.add_scatter(x=sizes, y=[model(S, n, loopback) * 1e3 for S in sizes], mode="lines",
                        line_dash="dot", name=f"{algo}, α-β model (fitted)")
    fig.update_layout(title=f"All-reduce time on {n} ranks (slowest rank's median of {repeats})",
                      xaxis_title="tensor size S (bytes)", yaxis_title="ms", height=420)
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return fig


def link_model_figure(links: list[Link], nbytes: float):
    """Log-log: the α-β model's all-reduce time of `nbytes` against N = 2 ... 1024, per link,
    ring (solid) and naive (dashed): modelled, not measured."""
    import plotly.graph_objects as go
    ns = [2**k for k in range(1, 11)]
    fig = go.Figure()
    for i, link in enumerate(links):
        color = f"hsl({i * 360 // len(links)},65%,45%)"
        for (algo, model), dash in zip(TIME_MODELS.items(), ("solid", "dash")):
            fig.add_scatter(x=ns, y=[model(nbytes, n, link) for n in ns], mode="lines",
                            line=dict(color=color, dash=dash), name=f"{link.name}: {algo}",
                            legendgroup=link.name)
    fig.update_layout(title=f"All-reduce of {nbytes / 1e6:g} MB: ring (solid) vs naive (dashed)",
                      xaxis_title="ranks N", yaxis_title="seconds", height=520)
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return fig
