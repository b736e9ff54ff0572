"""The exercises (distlab.exercises) on real ranks: each reference solution passes its check,
and a typical wrong answer fails with a message that says what is wrong (a value off, too many
collectives, the bias counted N times, GPipe's memory, a deadlock turned into a timeout).
The wrong answers are written here as a learner would write them in the notebook."""

import pytest
import torch
import torch.nn.functional as F

from distlab import exercises


@pytest.mark.parametrize("name", list(exercises.EXERCISES))
def test_the_reference_solution_passes(name):
    report = exercises.check(name, exercises.reference(name))
    print(report)
    assert report.ok, str(report)
    assert "def " in exercises.solution(name) and exercises.task(name)


# -- wrong answers, each as a learner might write it -------------------------------------------
def ring_without_all_gather(x, rank, world, exchange):
    chunks = list(x.chunk(world))
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send, recv = (rank - step) % world, (rank - step - 1) % world
        chunks[recv] += exchange(chunks[send], right, torch.empty_like(chunks[recv]), left)
    return x


def ring_that_deadlocks(x, rank, world, exchange):
    # receives from the right neighbour, who sends to its own right: nobody sends to rank 0
    right = (rank + 1) % world
    return exchange(x, right, torch.empty_like(x), right)


def hook_per_gradient(grads, world, all_reduce):
    for g in grads:  # one collective per tensor, and the sum is not divided
        all_reduce(g)


def zero1_without_momentum(flat_param, flat_grad, momentum, rank, world, lr, mu, all_gather):
    size = flat_param.numel() // world
    mine = slice(rank * size, (rank + 1) * size)
    all_gather(flat_param, flat_param[mine] - lr * flat_grad[mine])


def row_with_bias_before_the_sum(x, weight, bias, all_reduce):
    y = F.linear(x, weight, bias)
    all_reduce(y)
    return y


def gpipe_order(rank, p, m):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def backward_first(rank, p, m):
    return [("B", i) for i in range(m)] + [("F", i) for i in range(m)]


@pytest.mark.parametrize("name,fn,says", [
    ("ring", ring_without_all_gather, "wrong chunks"),
    ("ring", ring_without_all_gather, "the ring sends 2(N-1)/N of x"),
    ("bucket", hook_per_gradient, "8 all-reduces for 2 buckets: reduce each bucket in one"),
    ("bucket", hook_per_gradient, "not divided by the ranks"),
    ("zero1", zero1_without_momentum, "the parameters are off"),
    ("row", row_with_bias_before_the_sum, "the bias added before the all-reduce"),
    ("one_f_one_b", gpipe_order, "holds 8 micro-batches in flight; 1F1B holds at most"),
    ("one_f_one_b", backward_first, "deadlocks"),
])
def test_a_wrong_answer_fails_saying_what_differs(name, fn, says):
    report = exercises.check(name, fn)
    print(report)
    assert not report.ok and says in str(report), str(report)


def test_a_deadlock_ends_as_a_clear_timeout():
    report = exercises.ring.check(ring_that_deadlocks, timeout_s=5)
    print(report)
    assert not report.ok and "still waiting after 5 s: a deadlock?" in str(report), str(report)


def not_written(x, rank, world, exchange):
    raise NotImplementedError("your ring all-reduce here")


def test_a_stub_says_it_is_not_written_yet():
    report = exercises.check("ring", not_written)
    assert not report.ok and "not written yet" in str(report), str(report)


def test_an_unknown_exercise_or_a_non_function_is_refused():
    with pytest.raises(ValueError, match="no exercise 'rings'"):
        exercises.check("rings", gpipe_order)
    with pytest.raises(TypeError, match="pass the function itself"):
        exercises.check("ring", "def f(): pass")
