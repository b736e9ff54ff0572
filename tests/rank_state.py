"""A rank function for test_process_safety.py: what a rank starts with (a module, not a test
file, so ranks forked from the fork server import it by name)."""

import os
import random
import threading

import torch


def what_a_rank_starts_with(rank, world, device, log):
    return {"env": os.environ.get("DISTLAB_TEST_MARK", ""), "random": random.random(),
            "torch_seed": torch.initial_seed(), "threads": torch.get_num_threads(),
            "py_threads": threading.active_count(), "pid": os.getpid()}
