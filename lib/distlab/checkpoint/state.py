"""What a rank's checkpointed state is made of besides what its strategy hands over
(Strategy.checkpoint_state, built with distlab.parallel.state): the random-number states and
the loss scaler as tensors.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state(device: torch.device) -> dict:
    """Every random-number state a rank may draw from, as tensors and plain numbers."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device):
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def scaler_tensors(scaler) -> dict:
    return {f"scaler/{k}": torch.tensor(v, dtype=torch.float64)
            for k, v in scaler.state_dict().items()}
