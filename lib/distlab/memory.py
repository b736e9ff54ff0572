"""Memory per rank by category, measured from the tensors themselves.

On CPU a process's RSS says little at this scale (the torch runtime alone is ~220 MiB), so we
count bytes of the tensors we know: parameters, gradients and optimizer state held by this rank,
the tensors autograd saved for backward (activations), and scratch buffers of the collectives.
On CUDA we also report torch.cuda.max_memory_allocated for the step.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer=None) -> dict:
    """Bytes of parameters, gradients and optimizer state that live on this rank."""
    params = sum(tensor_bytes(p) for p in model.parameters())
    grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            optim += sum(tensor_bytes(v) for v in state.values() if torch.is_tensor(v))
    return {"params": params, "grads": grads, "optim": optim}


class ActivationMeter:
    """Counts bytes of tensors saved for backward during a forward pass.

    Autograd's saved-tensor hooks see every tensor a backward will need; several saves often
    share one storage (a view and its base), so storages are counted once.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.bytes = 0
        self._seen = set()

    def _pack(self, t):
        # Only plain tensors: wrapper subclasses (DTensor) have no storage of their own.
        if type(t) is torch.Tensor:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += storage.nbytes()
        return t

    @contextmanager
    def measure(self):
        # Weights saved for backward (linear saves its weight) are parameters, not activations:
        # mark their storages as seen so they are not counted.
        self.bytes = 0
        self._seen = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
        self._seen = set()
