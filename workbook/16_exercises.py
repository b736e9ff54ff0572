# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 16 · Exercises: write it yourself, checked on real ranks
#
# Reading a ring all-reduce is not writing one. Each exercise below is a function you write in
# its cell; the call under it runs your function on real ranks (spawned processes talking over
# gloo, as every notebook here does) against the reference, and says what differs: the values,
# the bytes your code put on the wire against the formula, and a deadlock as a clear timeout
# instead of a frozen cell.
#
# 1. ring all-reduce from send/recv (`01_collectives`);
# 2. DDP's bucket hook (`02_data_parallel`);
# 3. a ZeRO-1 optimizer step (`04_zero_and_fsdp`);
# 4. Megatron's column- and row-parallel linear layers (`05_tensor_parallel`);
# 5. the 1F1B pipeline schedule (`06_pipeline_parallel`).
#
# Your function must be self-contained: on the ranks it sees `torch`, `F`
# (torch.nn.functional) and its own arguments, not this notebook's other names. Each cell
# starts with a stub that raises; replace its body and run the cell. `exercises.solution(name)`
# prints the reference when you want it; the last section checks every reference (CI runs it).

# %%
from distlab import exercises

# %% [markdown]
# ## 1. Ring all-reduce
#
# `x` is this rank's 1-D tensor (4 ranks, 4096 values; its length divides by the ranks). Return
# the sum over the ranks. `exchange(send_t, to, recv_t, frm)` sends `send_t` to rank `to`
# while receiving into `recv_t` from rank `frm`, and returns `recv_t`.
#
# Cut x into `world` chunks (`x.chunk(world)` gives views: adding into them adds into x).
# **Reduce-scatter**: world-1 steps; at step s, send chunk (rank-s) mod N to the right
# neighbour and add the chunk arriving from the left into chunk (rank-s-1) mod N. Now chunk
# (rank+1) mod N holds the sum. **All-gather**: world-1 more steps pass the summed chunks
# around, copying instead of adding. The check wants the sum and exactly 2(N-1)/N of x sent.

# %%
def ring_all_reduce(x, rank, world, exchange):
    raise NotImplementedError("your ring all-reduce here")


exercises.check("ring", ring_all_reduce)

# %% [markdown]
# ## 2. DDP's bucket hook
#
# Backward produces gradients layer by layer, last layer first; DDP groups them into buckets
# and, as soon as a bucket's last gradient is in, calls a hook that launches one all-reduce for
# the whole bucket, while backward goes on with the layers before it. Write the hook: make each
# gradient of `grads` (one bucket) the mean over the ranks, in place. `all_reduce(t)` sums `t`
# over the ranks in place; each call is one collective. The check runs a 4-layer MLP on 2
# ranks (2 buckets) and wants one process's gradients and one all-reduce per bucket.

# %%
def bucket_hook(grads, world, all_reduce):
    raise NotImplementedError("your bucket hook here")


exercises.check("bucket", bucket_hook)

# %% [markdown]
# ## 3. A ZeRO-1 optimizer step
#
# `flat_param` and `flat_grad` are the whole model flattened (P values, P divisible by
# `world`); the gradient is already the mean over the ranks. `momentum` is this rank's
# optimizer state: P/world values, for its shard only. Step SGD with momentum on your shard
# (m = mu·m + g, p = p − lr·m), then `all_gather(flat_param, your_new_shard)` gives every rank
# every shard. The check: 4 ranks, 4 steps, against one process's SGD on the whole vector.

# %%
def zero1_step(flat_param, flat_grad, momentum, rank, world, lr, mu, all_gather):
    raise NotImplementedError("your ZeRO-1 step here")


exercises.check("zero1", zero1_step)

# %% [markdown]
# ## 4. Column- and row-parallel linear layers
#
# A Linear's weight is (out, in). **Column-parallel**: this rank holds out/N of its rows (and
# of the bias) and the whole input; it computes its block of the output columns, with no
# communication. **Row-parallel**: this rank holds in/N of the weight's columns and its block
# of the input features (the column-parallel layer's output, after an elementwise GELU); its
# product is a partial sum of every output, which `all_reduce` completes. Where does the
# bias go? The check runs an MLP 16 → 64 → 16 on 2 ranks against one process.

# %%
def column_parallel(x, weight, bias):
    raise NotImplementedError("your column-parallel linear here")


def row_parallel(x, weight, bias, all_reduce):
    raise NotImplementedError("your row-parallel linear here")


exercises.check("column", column_parallel)

# %%
exercises.check("row", row_parallel)

# %% [markdown]
# ## 5. The 1F1B schedule
#
# Return the order in which pipeline stage `rank` (of `p`) runs the forwards and backwards of
# `m` micro-batches: a list of `("F", i)` and `("B", i)`. GPipe (all forwards, then all
# backwards) is correct but holds m micro-batches' activations on every stage; 1F1B warms up
# with p−1−rank forwards, then alternates one forward and one backward, and never holds more
# than p−rank. The check first simulates your order (every op once, no deadlock, the memory
# bound), then runs it on 4 real ranks with `distlab.PipelineSchedule` and compares the
# gradients with one process's.

# %%
def one_f_one_b(rank, p, m):
    raise NotImplementedError("your 1F1B order here")


exercises.check("one_f_one_b", one_f_one_b)

# %% [markdown]
# ## The references, checked
#
# Each reference solution through the same check (what CI runs). Their sources are not printed
# here, so the exercises above stay exercises: `exercises.solution(name)` shows one when you
# want it (run `print(exercises.solution("ring"))` in a cell of your own).

# %%
reports = {name: exercises.check(name, exercises.reference(name)) for name in exercises.EXERCISES}
for report in reports.values():
    print(report)
assert all(r.ok for r in reports.values()), [n for n, r in reports.items() if not r.ok]
