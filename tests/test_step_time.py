"""distlab.theory.step_time: the predicted step is compute plus the exposed communication, and
each strategy's exposed figure is the sum of its named terms, built from the α-β costs as its
overlap rule says. Pure arithmetic, no processes: the benchmark (benchmarks/step_model.py)
sets predictions beside measured steps."""

from __future__ import annotations

import math

import pytest

from distlab.theory.step_time import (EXPOSED, AlphaBeta, Compute, behind, predict)

FITS = {"all_reduce": AlphaBeta(1e-4, 1e9), "all_gather": AlphaBeta(5e-5, 2e9),
        "reduce_scatter": AlphaBeta(5e-5, 1e9)}
C = Compute(forward=0.010, backward=0.020, optimizer=0.004)
MB = 1_000_000


def booked(**kinds):
    return {k: {"calls": n, "bytes_sent": b} for k, (n, b) in kinds.items()}


def test_alpha_beta_is_linear_so_a_kind_costs_calls_alpha_plus_bytes_over_beta():
    ab = AlphaBeta(1e-4, 1e9)
    assert ab.seconds(3, 3 * MB) == pytest.approx(3e-4 + 3e-3)
    # whatever the calls' sizes: one call of 2 MB and one of 1 MB cost what two of 1.5 do
    assert ab.seconds(1, 2 * MB) + ab.seconds(1, MB) == pytest.approx(ab.seconds(2, 3 * MB))


def test_behind_hides_all_but_one_call_behind_the_compute_left():
    assert behind(total=0.010, unhidden=0.002, compute=0.050) == pytest.approx(0.002)
    assert behind(total=0.010, unhidden=0.002, compute=0.005) == pytest.approx(0.005)
    assert behind(total=0.010, unhidden=0.002, compute=0.0) == pytest.approx(0.010)
    assert behind(total=0.001, unhidden=0.002, compute=0.0) == pytest.approx(0.001)


@pytest.mark.parametrize("strategy,kinds", [
    ("allreduce", booked(all_reduce=(37, 4 * MB))),
    ("ddp", booked(all_reduce=(4, 4 * MB))),
    ("zero1", booked(reduce_scatter=(5, 2 * MB), all_gather=(5, 2 * MB))),
    ("zero2", booked(reduce_scatter=(5, 2 * MB), all_gather=(5, 2 * MB))),
    ("zero3", booked(reduce_scatter=(5, 2 * MB), all_gather=(10, 4 * MB))),
])
def test_terms_add_up(strategy, kinds):
    p = predict(strategy, 2, C, kinds, FITS)
    assert p.exposed == pytest.approx(sum(p.terms.values()))
    assert p.total == pytest.approx(p.compute.total + p.exposed)
    for k, v in kinds.items():
        assert p.comm[k] == pytest.approx(FITS[k].seconds(v["calls"], v["bytes_sent"]))
    # communication is never more than exposed in full, and never less than nothing
    assert 0 <= p.exposed <= p.comm_total + 1e-12


def test_compute_of_a_step_keeps_the_step_and_the_plain_split():
    c = Compute.of_step(0.068, C)  # the strategy's one-process step: 2x the plain model's
    assert c.total == pytest.approx(0.068)
    assert (c.forward, c.backward, c.optimizer) == pytest.approx((0.020, 0.040, 0.008))
    z = Compute.of_step(0.032, C, optimizer_share=1 / 2)  # ZeRO steps half the parameters
    assert z.total == pytest.approx(0.032)
    assert z.optimizer / z.backward == pytest.approx(C.optimizer / 2 / C.backward)


def test_tp_waits_on_every_all_reduce():
    kinds = booked(**{"tp.all_reduce": (16, 8 * MB)})
    p = predict("tp", 2, C, kinds, FITS)
    assert p.exposed == pytest.approx(FITS["all_reduce"].seconds(16, 8 * MB))
    assert p.exposed == pytest.approx(sum(p.terms.values()))


def test_pp_pays_the_bubble_and_the_fill_and_drain_hops():
    fits = {**FITS, "send": AlphaBeta(2e-4, 1e9)}
    kinds = booked(pp_send_act=(4, 4 * MB), barrier=(2, 0), pp_recv_grad=(4, 0))
    p = predict("pp", 2, C, kinds, fits, microbatches=4)
    bubble = (2 - 1) / 4 * (C.forward + C.backward)
    hop = fits["send"].seconds(4, 4 * MB) / 4  # one micro-batch's activation
    barriers = FITS["all_reduce"].seconds(2, 0)
    assert p.exposed == pytest.approx(bubble + 2 * hop + barriers)
    assert p.exposed == pytest.approx(sum(p.terms.values()))
    more = predict("pp", 2, C, kinds, fits, microbatches=8)  # m up: the bubble shrinks
    assert more.exposed < p.exposed


def test_cp_hides_its_hops_behind_ring_attention_only():
    fits = {**FITS, "send": AlphaBeta(1e-4, 1e9)}
    kinds = booked(**{"cp.kv": (32, 8 * MB), "cp.dkv": (32, 8 * MB)}, all_reduce=(1, MB))
    hops = 2 * fits["send"].seconds(32, 8 * MB)
    last = fits["send"].seconds(32, 8 * MB) / 2
    grads = FITS["all_reduce"].seconds(1, MB)
    covered = predict("cp", 2, Compute(0.01, 0.02, 0.004, attention=0.05), kinds, fits)
    assert covered.exposed == pytest.approx(last + grads)
    bare = predict("cp", 2, Compute(0.01, 0.02, 0.004, attention=0.0), kinds, fits)
    assert bare.exposed == pytest.approx(hops + grads)


def test_rules_differ_where_the_strategies_do():
    kinds = booked(all_reduce=(4, 4 * MB))
    comm = FITS["all_reduce"].seconds(4, 4 * MB)  # 4.4 ms: less than backward's 20 ms
    flat = predict("allreduce", 2, C, kinds, FITS)
    ddp = predict("ddp", 2, C, kinds, FITS)
    assert flat.exposed == pytest.approx(comm)  # nothing hides after backward
    assert ddp.exposed == pytest.approx(comm / 4)  # all but the last bucket hide
    slow = {**FITS, "all_reduce": AlphaBeta(1e-4, 1e8)}  # 40 ms of buckets: 20 ms stick out
    ddp_slow = predict("ddp", 2, C, kinds, slow)
    total = slow["all_reduce"].seconds(4, 4 * MB)
    assert ddp_slow.exposed == pytest.approx(total - C.backward)
    z1 = predict("zero1", 2, C, booked(reduce_scatter=(5, 2 * MB), all_gather=(5, 2 * MB)), FITS)
    z2 = predict("zero2", 2, C, booked(reduce_scatter=(5, 2 * MB), all_gather=(5, 2 * MB)), FITS)
    assert z2.exposed < z1.exposed  # zero2's reduce-scatters run inside backward


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="prediction exists"):
        predict("ep", 2, C, {}, FITS)
    with pytest.raises(ValueError, match="no fitted kind prices"):
        predict("ddp", 2, C, booked(all_to_all=(1, MB)), FITS)
    with pytest.raises(ValueError, match="microbatches"):
        predict("pp", 2, C, {}, FITS, microbatches=0)
    with pytest.raises(ValueError, match="no α-β fit"):
        predict("ddp", 2, C, booked(all_reduce=(1, MB)), {})
    with pytest.raises(ValueError, match="world"):
        predict("ddp", 0, C, {}, FITS)
    assert set(EXPOSED) >= {"allreduce", "ddp", "zero1", "zero2", "zero3"}
    assert math.isclose(predict("single", 1, C, {}, FITS).total, C.total)


def test_growth_summary_finds_the_crossover_and_the_worst_deviation():
    # ddp over ranks at one width (and two widths at 2 ranks): the modelled all-reduce grows
    # with the ranks while compute does not, so communication overtakes at the first point
    # where it costs more; the worst deviation is the largest |measured / predicted - 1|.
    from distlab.lab.how_far import growth_curves, growth_summary

    def point(world, n_embd, all_reduce_bytes, measured_over_predicted):
        fits = {"all_reduce": AlphaBeta(1e-3 * world, 1e9)}
        kinds = booked(all_reduce=(4, all_reduce_bytes)) if world > 1 else {}
        p = predict("ddp" if world > 1 else "single", world, C, kinds, fits)
        return {"world": world, "n_embd": n_embd, "prediction": p,
                "measured_s": measured_over_predicted * p.total,
                "serial_s": p.compute.total + p.comm_total}

    points = [point(4, 64, 8 * MB, 1.1), point(1, 64, 0, 1.0), point(2, 64, 4 * MB, 1.3),
              point(8, 64, 16 * MB, 0.9), point(2, 32, 2 * MB, 1.05)]
    curves = growth_curves(points)
    assert [p["world"] for p in curves["ranks"]] == [1, 2, 4, 8]
    assert [p["n_embd"] for p in curves["width"]] == [32, 64]
    got = growth_summary(points)
    comm = {p["world"]: p["prediction"].comm_total for p in curves["ranks"]}
    first = min(w for w in comm if comm[w] > C.total)  # 8 ranks: 4 x 8 ms + 16 ms > 34 ms
    assert got["ranks"]["crossover"]["world"] == first == 8
    assert got["ranks"]["worst"] == pytest.approx(0.3)
    assert got["width"]["crossover"] is None and got["width"]["worst"] == pytest.approx(0.3)


def test_core_wait_splits_the_training_threads_wait_from_the_others():
    """distlab.rank.step_meter: each thread's run_delay difference over the step, the calling
    (training) thread's apart; a thread born during the step counts from zero."""
    import sys
    import threading

    from distlab.rank.step_meter import core_wait, run_queue_delays
    me = threading.get_native_id()
    got = core_wait({me: 1_000, 7: 5_000}, {me: 3_000_000, 7: 2_005_000, 8: 1_000_000})
    assert got == pytest.approx({"main": 0.002999, "others": 0.003})
    assert core_wait(None, {me: 1}) is None
    if sys.platform == "linux":  # the kernel's schedstat: this thread is among them
        delays = run_queue_delays()
        assert me in delays and all(ns >= 0 for ns in delays.values())


def test_blocked_by_core_wait_compares_the_halves_of_the_steps():
    from distlab.studies.step_limit import blocked_by_core_wait

    def step(others, blocked):
        return {"step_s": 0.1, "prefetch": {"blocked_s": blocked},
                "cpu": {"wait_s": {"main": 0.001, "others": others}}}
    steps = [step(0.01, 0.001), step(0.03, 0.009), step(0.02, 0.002), step(0.04, 0.007)]
    got = blocked_by_core_wait(steps)
    assert got["blocked_least_waiting"] == pytest.approx(0.015)  # the steps waiting 10, 20 ms
    assert got["blocked_most_waiting"] == pytest.approx(0.08)
    assert got["others_wait_s"] == pytest.approx(0.025) and got["main_wait_s"] == 0.001
    assert blocked_by_core_wait(steps[:3]) is None  # too few steps to halve
