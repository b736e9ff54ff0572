"""distlab.wire: the bytes the kernel saw each rank write, per collective and per step.

Tolerances: gloo frames every message with a 48-byte header (measured: a 4 MiB all-reduce at
4 ranks writes 1,728 bytes over the ring formula in 36 messages), so on 4 MiB tensors the
formulas hold to 0.03%; 2% leaves room for a few hundred stray bytes and for gloo changing its
framing, while a wrong algorithm (a factor of 2 for reduce-scatter, the tree's 0 or 2S for
broadcast) stays far outside it.
"""

import pytest

from distlab import RunConfig, run_ranks, wire
from distlab.comm import ring_allreduce_bytes
from distlab.events import EventLog
from distlab.lab.collectives import wire_per_collective, wire_rows
from distlab.lab.runs import launch_together

pytestmark = pytest.mark.skipif(not wire.available(), reason="needs Linux's /proc/self/io")

S = 4 << 20  # bytes of float32 per collective


@pytest.fixture(scope="module")
def per_collective():
    return {r["kind"] + f"/{r['rank']}": r
            for r in wire_rows(run_ranks(wire_per_collective, 4, S, timeout_s=60))}


def wire_of(rows, kind, rank):
    return rows[f"{kind}/{rank}"]["wire"]


@pytest.mark.parametrize("kind,formula", [
    ("all_reduce", ring_allreduce_bytes(S, 4)),          # 2(N-1)/N·S
    ("all_gather", 3 * S / 4),                           # (N-1)/N·|out|
    ("all_reduce.ring", ring_allreduce_bytes(S, 4)),     # ours: counted message by message
    ("all_to_all", 3 * S / 4),                           # (N-1)/N of the buffer
])
def test_where_gloo_follows_the_textbook_the_wire_is_within_2_percent(per_collective, kind,
                                                                       formula):
    for rank in range(4):
        assert wire_of(per_collective, kind, rank) == pytest.approx(formula, rel=0.02)


def test_gloo_reduce_scatter_writes_as_much_as_an_all_reduce(per_collective):
    # the ring's reduce-scatter would write (N-1)/N·S; gloo's writes 2(N-1)/N·S
    for rank in range(4):
        w = wire_of(per_collective, "reduce_scatter", rank)
        assert w == pytest.approx(ring_allreduce_bytes(S, 4), rel=0.02)
        assert per_collective[f"reduce_scatter/{rank}"]["booked"] == 3 * S / 4


def test_gloo_broadcast_is_a_tree_not_a_chain(per_collective):
    # binomial tree from rank 0 at N=4: 0 -> 2, then 0 -> 1 and 2 -> 3
    sent = sorted(wire_of(per_collective, "broadcast", r) for r in range(4))
    assert sent[0] < 0.01 * S and sent[1] < 0.01 * S  # two leaves send (almost) nothing
    assert sent[2] == pytest.approx(S, rel=0.02)
    assert sent[3] == pytest.approx(2 * S, rel=0.02)
    assert wire_of(per_collective, "broadcast", 0) == sent[3]  # the root sends twice


def test_naive_all_reduce_root_moves_n_minus_1_copies(per_collective):
    assert wire_of(per_collective, "all_reduce.naive", 0) == pytest.approx(3 * S, rel=0.02)
    for rank in (1, 2, 3):
        assert wire_of(per_collective, "all_reduce.naive", rank) == pytest.approx(S, rel=0.02)


def own_writes_do_not_count(rank, world, device, log, nbytes):
    """A rank writes `nbytes` of events to its own log inside a measured window."""
    from distlab.comm import Comm
    Comm()  # opens the ledger for this process group's backend
    wire.LEDGER.begin()
    side = EventLog(log.path + ".side", rank)
    for _ in range(nbytes // 1000):
        side.write("note", pad="x" * 1000)
    side.close()
    return wire.LEDGER.end()["sent"]


def test_a_ranks_own_file_writes_are_not_wire_bytes():
    sent = run_ranks(own_writes_do_not_count, 2, 1 << 20, timeout_s=60)
    assert all(s < 1000 for s in sent), sent  # a MiB written to files, < 1 KB counted


@pytest.fixture(scope="module")
def steps():
    base = dict(world_size=2, steps=2, n_layer=1, n_embd=32, n_head=2)
    names = ["ddp", "zero2", "fsdp-torch"]
    return launch_together({n: RunConfig(strategy=n, **base) for n in names}, name="wire")


def test_every_step_event_has_wire_bytes_beside_the_booked(steps):
    for name, run in steps.items():
        for e in run.history("step"):
            booked = sum(v["bytes_sent"] for v in e["comm"].values())
            w = e["wire"]
            assert w["sent"] == sum(w["by_kind"].values()), (name, w)
            if name == "ddp":  # async buckets, measured over the step: the ring formula
                assert w["sent"] == pytest.approx(booked, rel=0.02)
                assert set(w["by_kind"]) == {"all_reduce"}
            if name == "zero2":  # gloo's reduce-scatter doubles the gradient traffic
                ddp = steps["ddp"].history("step", rank=e["rank"])[0]["wire"]["sent"]
                assert w["sent"] == pytest.approx(1.5 * ddp, rel=0.02)
            if name == "fsdp-torch":  # torch's own collectives: nothing booked, all measured
                assert booked == 0 and w["by_kind"].keys() == {"not booked"}
                assert w["sent"] > 0


def test_nccl_and_systems_without_the_counter_say_so_instead_of_zero():
    assert wire.visible("nccl") == wire.WIRE_UNSEEN
    led = wire.Ledger()
    led.open("nccl")
    out = led.end()
    assert out["sent"] is None and "NCCL" in out["why"]


def test_the_dashboard_draws_booked_and_wire_bytes_side_by_side(steps):
    from distlab.lab.common import MiB
    from distlab.lab.panel import bytes_sent, dashboard_for, step_events, wire_sent
    run = steps["zero2"]
    dash = dashboard_for(run)
    dash._draw_ranks(run, "zero2")
    traces = {t.name: t for t in dash.fig.data}
    booked, on_wire = traces["booked"], traces["on the wire"]
    last = step_events(run, run.steps_done() - 1)
    assert list(on_wire.customdata) == [wire_sent(e) for e in last]
    assert list(booked.customdata) == [bytes_sent(e) for e in last]
    # gloo's reduce-scatter: zero2's wire bar stands taller than its booked one
    assert all(w / MiB > b / MiB * 1.3 for w, b in zip(on_wire.y, booked.y))
