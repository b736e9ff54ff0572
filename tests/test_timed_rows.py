"""The timed claims rows of notebooks 06-09 (issue 42, item 1), fed synthetic repeats: each
reads yes, no, or undecided (None) from the samples alone, with no clock read here."""

from distlab.lab.checkpoints_and_faults import dead_rank_claim
from distlab.lab.lora_finetuning import merge_latency_claim
from distlab.lab.parallelism_3d import planner_order_claim
from distlab.lab.pipeline_parallel import bubble_curve_claim, interleaving_claim, \
    naive_bubble_claim


def around(x, n=5, width=0.01):
    """n samples spread ±width around x."""
    return [x + width * (2 * i / (n - 1) - 1) for i in range(n)]


def bubble(m, samples, p=2, v=1):
    total = (p - 1) / (m + p - 1)
    return {"p": p, "m": m, "v": v, "samples": samples, "total": total,
            "ideal": (p - 1) / (v * m)}


def test_bubble_curve_falls_and_fits_or_says_why_not():
    good = [bubble(m, around(1 / (m + 1))) for m in (1, 2, 4)]
    row = bubble_curve_claim(good, 0.05)
    assert row["holds"] is True and row["basis"] == "timed"
    flat = [bubble(m, around(0.5)) for m in (1, 2, 4)]  # does not fall, nor fit m = 2, 4
    assert bubble_curve_claim(flat, 0.05)["holds"] is False
    few = [bubble(m, around(1 / (m + 1), n=2)) for m in (1, 2, 4)]
    assert bubble_curve_claim(few, 0.05)["holds"] is None


def test_interleaving_and_naive_bubble_rows():
    f1, il = bubble(4, around(0.2, width=0.002)), bubble(4, around(0.111, width=0.002), v=2)
    assert interleaving_claim(f1, il, 2)["holds"] is True  # idle/busy 0.25 vs 0.125
    assert interleaving_claim(f1, bubble(4, around(0.19), v=2), 2)["holds"] is False
    assert interleaving_claim(f1, bubble(4, around(0.15, width=0.05), v=2), 2)["holds"] is None
    assert naive_bubble_claim(bubble(4, around(0.5)), 0.05)["holds"] is True
    assert naive_bubble_claim(bubble(4, around(0.7)), 0.05)["holds"] is False
    assert naive_bubble_claim(bubble(4, around(0.55)), 0.05)["holds"] is None


def layout(rank, predicted, repeats):
    return {"rank": rank, "layout": f"L{rank}", "predicted_s": predicted, "spread_s": repeats}


def test_planner_order_row():
    def pc(a, b, pred_b=0.03):
        return {"rows": [layout(1, 0.02, a), layout(2, pred_b, b)]}
    assert planner_order_claim(pc(around(0.04), around(0.06)))["holds"] is True
    assert planner_order_claim(pc(around(0.06), around(0.04)))["holds"] is False
    assert planner_order_claim(pc(around(0.04, 2), around(0.06, 2)))["holds"] is None
    # predicted within 5% of each other: no pair to test, undecided
    assert planner_order_claim(pc(around(0.06), around(0.04), 0.0201))["holds"] is None


def test_merge_latency_row_reads_the_pairs():
    def m(merged, plain):
        return {"merged_samples": merged, "plain_samples": plain, "merged_s": merged[2],
                "plain_s": plain[2], "unmerged_s": 0.002, "max_diff_merged": 1e-6}
    plain = around(0.001, width=1e-5)
    assert merge_latency_claim(m(around(0.001, width=1e-5), plain))["holds"] is True
    assert merge_latency_claim(m(around(0.002, width=1e-5), plain))["holds"] is False
    assert merge_latency_claim(m([0.001, 0.0013, 0.00124, 0.0012, 0.0014], plain))["holds"] \
        is None


def test_dead_rank_row():
    assert dead_rank_claim(True, [0.05, 0.06, 0.07])["holds"] is True
    assert dead_rank_claim(True, [11.0, 12.0, 13.0])["holds"] is False
    assert dead_rank_claim(False, [0.05, 0.06, 0.07])["holds"] is False
    assert dead_rank_claim(True, [0.05])["holds"] is None  # one drill cannot decide
