"""Memory per rank by category, measured from the tensors themselves.

On CPU a process's RSS says little at this scale (the torch runtime alone is ~220 MiB), so we
count bytes of the tensors we know: parameters, gradients and optimizer state held by this rank,
the tensors autograd saved for backward (activations), and scratch buffers of the collectives.

Three measures, all in bytes (see distlab.theory.estimate for the analytic side of each):

  model_state_bytes(model, opt)  exact bytes of this rank's params, grads and optimizer state
                                 (numel * element_size of each local tensor; nothing shared)
  ActivationMeter                bytes of the tensors autograd saved for backward in a forward
                                 (each storage once; parameters, and autocast's low-precision
                                 copies of them, excluded: those are counted apart)
  PeakMemoryTracker              live bytes of every storage aten ops allocated, and the peak
                                 of that over a step: the CPU stand-in for
                                 torch.cuda.max_memory_allocated. It sees allocations made by
                                 aten ops only: it misses buffers made inside gloo (and any
                                 allocation outside the dispatcher).

The step event's memory dict (distlab.rank.train): params, grads, optim (Strategy.state_bytes),
activations (ActivationMeter, last micro-batch), comm_buffers; with RunConfig.track_peak also
peak (this step's PeakMemoryTracker peak) and allocated (live at the step's end) - opt-in, as
the tracker costs ~15-25% of a step of the default GPT; on CUDA also cuda_max_allocated
(torch.cuda.max_memory_allocated for the step).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distlab.units import tensor_bytes

_PLAIN = (torch.Tensor, torch.nn.Parameter)
PEAK_LABEL = ("peak bytes allocated by aten ops in the step: the CPU stand-in for "
              "torch.cuda.max_memory_allocated; misses buffers made inside gloo")


def model_state_bytes(model: torch.nn.Module, optimizer=None) -> dict:
    """Bytes of parameters, gradients and optimizer state that live on this rank."""
    params = sum(tensor_bytes(p) for p in model.parameters())
    grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            optim += sum(tensor_bytes(v) for v in state.values() if torch.is_tensor(v))
    return {"params": params, "grads": grads, "optim": optim}


# Meters measuring now (innermost last). Selective activation checkpointing keeps some op
# outputs in its own cache instead of saving them through autograd's hooks; distlab.rank.recompute
# reports those here (count_saved) so the meter still sees every byte kept for backward.
_ACTIVE_METERS: list["ActivationMeter"] = []


def count_saved(t: torch.Tensor):
    """Count `t` as kept for backward by the meter measuring now, if any."""
    if _ACTIVE_METERS:
        _ACTIVE_METERS[-1]._pack(t)


class ActivationMeter:
    """Counts bytes of tensors saved for backward during a forward pass.

    Autograd's saved-tensor hooks see every tensor a backward will need; several saves often
    share one storage (a view and its base), so storages are counted once. Under activation
    checkpointing only what the checkpoint keeps is seen (the block inputs; with selective
    checkpointing also the op outputs it caches, reported through count_saved); what the
    recomputation holds during backward is transient and shows in PeakMemoryTracker instead.

    Under autocast (bf16/fp16) a matmul saves the low-precision *copy* of its weight that
    autocast made (`weight.to(bf16)`, cached for the forward). That copy is 2 bytes per weight
    whatever the batch: a cast of a parameter, not an activation. It is counted apart, in
    `param_cast_bytes`: a saved tensor (or the base of a saved view) whose grad_fn is a dtype
    copy (ToCopyBackward0) of a parameter of the model (its AccumulateGrad's variable). Casts
    of activations (a matmul's input cast to bf16) stay activations. `by_dtype` splits `bytes`
    by dtype (under autocast some saved tensors stay float32: LayerNorm inputs, the residual
    stream, log_softmax's output).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.bytes = 0
        self.param_cast_bytes = 0  # autocast's low-precision copies of parameters (see above)
        self.by_dtype: dict[str, int] = {}  # `bytes` split by dtype name ("float32", ...)
        self._seen = set()  # data pointers of the activations' storages counted
        self._param_storages = set()  # the parameters' StorageImpls (see measure)

    def _is_param_cast(self, t) -> bool:
        base = t._base if t._base is not None else t
        fn = base.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0":
            return False
        if len(fn.next_functions) != 1:
            return False
        var = getattr(fn.next_functions[0][0], "variable", None)  # AccumulateGrad's leaf
        return (type(var) in _PLAIN
                and var.untyped_storage()._cdata in self._param_storages)

    def _pack(self, t):
        # Only plain tensors: wrapper subclasses (DTensor) have no storage of their own.
        if type(t) in _PLAIN:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self._seen and storage._cdata not in self._param_storages:
                self._seen.add(key)
                if self._is_param_cast(t):
                    self.param_cast_bytes += storage.nbytes()
                else:
                    self.bytes += storage.nbytes()
                    dtype = str(t.dtype).replace("torch.", "")
                    self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + storage.nbytes()
        return t

    @contextmanager
    def measure(self):
        # Weights saved for backward (linear saves its weight) are parameters, not activations:
        # known by their StorageImpl, not by data pointer: ZeRO-3 frees and re-gathers
        # parameter buffers in place (resize_), which moves their data but keeps the
        # StorageImpl, and memory a unit held when forward began (gathered between steps) can
        # be an activation's by the time it is saved.
        self.bytes, self.param_cast_bytes, self.by_dtype = 0, 0, {}
        params = [p for p in self.model.parameters()
                  if type(p) in _PLAIN]  # a DTensor (FSDP2) has no storage of its own
        self._seen = set()  # activations' storages counted (by data pointer: saved twice)
        self._param_storages = {p.untyped_storage()._cdata for p in params}
        _ACTIVE_METERS.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            _ACTIVE_METERS.remove(self)
            self._seen, self._param_storages = set(), set()


class PeakMemoryTracker(TorchDispatchMode):
    """Live bytes of the storages aten ops allocate, and their peak: on CPU, the stand-in for
    torch.cuda.memory_allocated / max_memory_allocated.

    While the mode is active every aten op passes through __torch_dispatch__. Each output that
    is a new storage (not a view or an in-place result: the op's schema says which outputs
    alias an input) is recorded with its nbytes, and a weakref callback on the storage takes
    the bytes off again when the storage is freed, whenever and wherever that happens (the mode
    need not be active then). `current` is the bytes of recorded storages still alive; `peak`
    is the most `current` reached since reset_peak().

    What it misses (label it so): memory allocated outside the aten dispatcher, notably the
    buffers gloo makes inside a collective (and torch.from_numpy's arrays); storages made
    before tracking began, unless handed to adopt() (the model's parameters, say); a storage
    resized in place after it was made (out= ops) keeps its first size. Wrapper subclasses
    (DTensor) are skipped: only type(t) in (Tensor, Parameter) is counted (a DTensor's storage
    access fails, and its local tensor is the plain tensor that is counted).

    Cost: one Python call per aten op, ~1,200 ops in a step of the default GPT with AdamW:
    +15-25% step time there, 2-3x on the tiny test models (about half of it is the price of
    any Python dispatch mode). Hence opt-in: RunConfig.track_peak. Measured by
    benchmarks/memory_checkpointing.py.

        tracker = PeakMemoryTracker()
        tracker.adopt(model.parameters())
        with tracker:          # or tracker.step_begin() ... tracker.step_end()
            loss = model(x, y); loss.backward(); opt.step()
        tracker.peak, tracker.current
    """

    label = PEAK_LABEL

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}  # StorageImpl address -> nbytes, for storages alive
        self._keys: dict[int, tuple] = {}  # id(weakref) -> (StorageImpl address, weakref)
        self._fresh: dict = {}  # op -> which of its returns are new storages (from its schema)
        self._entered = False

    def _track(self, t: torch.Tensor):
        if type(t) not in _PLAIN or t.is_meta:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            return
        key = storage._cdata  # the StorageImpl's address: unique while the storage lives
        if key in self._live:
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        # a weakref's callback runs when the storage is freed (cheaper than weakref.finalize)
        ref = weakref.ref(storage, self._free)
        self._live[key] = nbytes
        self._keys[id(ref)] = (key, ref)
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current

    def _free(self, ref):
        key, _ = self._keys.pop(id(ref), (None, None))
        self.current -= self._live.pop(key, 0)

    def adopt(self, tensors):
        """Count already-allocated tensors (parameters, buffers, optimizer state) as live."""
        for t in tensors:
            if torch.is_tensor(t):
                self._track(t)

    def reset_peak(self):
        self.peak = self.current

    def step_begin(self, *tensors):
        """Count `tensors` (the step's batch, made before) as live, start a new peak and enter
        the mode (the loop calls this at the top of a step; step_end leaves it)."""
        self.adopt(tensors)
        self.reset_peak()
        if not self._entered:
            self.__enter__()
            self._entered = True

    def step_end(self) -> int:
        """Leave the mode; return the step's peak bytes."""
        if self._entered:
            self.__exit__(None, None, None)
            self._entered = False
        return self.peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = self._fresh.get(func)
        if fresh is None:
            # a return with alias_info is a view or an in-place/out= result: no new storage;
            # except lift_fresh, which hands a tensor made from Python data (torch.tensor(...),
            # e.g. AdamW's step counters) to the dispatcher for the first time
            fresh = self._fresh[func] = (
                (True,) if func is torch.ops.aten.lift_fresh.default
                else tuple(r.alias_info is None for r in func._schema.returns))
        if type(out) is torch.Tensor:
            if fresh[0]:
                self._track(out)
        elif isinstance(out, (tuple, list)) and any(fresh):
            if len(fresh) == len(out):
                for is_fresh, o in zip(fresh, out):
                    if is_fresh:
                        for t in tree_leaves(o):
                            if isinstance(t, torch.Tensor):
                                self._track(t)
            elif all(fresh):  # one Tensor[] return
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        self._track(t)
        return out
