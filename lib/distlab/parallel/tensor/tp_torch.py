"""`tp-torch`: the same Megatron split done by torch's DTensor tensor parallelism, the
reference `tp` (distlab.parallel.tensor.tp) is checked against.

`parallelize_module` on a 1-D CPU mesh of tp ranks with ColwiseParallel (q, k, v, mlp.fc) and
RowwiseParallel (attn.o, mlp.proj); with sp=True also SequenceParallel on the LayerNorms and
PrepareModuleInput where the residual stream enters/leaves the sequence-sharded region (the
Megatron-SP plan of torch's docs). Embeddings and head stay replicated plain tensors.
torch's collectives do not go through distlab.comm, so their bytes are not counted here.
"""

from __future__ import annotations

from distlab.parallel.base import Strategy


def torch_tp_plan(n_layer: int, sp: bool = False) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    plan = {}
    if sp:  # the embeddings' replicated output -> this rank's block of the sequence
        plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                              desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
    for i in range(n_layer):
        b = f"blocks.{i}"
        row = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        if sp:
            plan |= {f"{b}.ln1": SequenceParallel(), f"{b}.ln2": SequenceParallel(),
                     f"{b}.attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                                     desired_input_layouts=(Replicate(),)),
                     f"{b}.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),))}
        plan |= {f"{b}.attn.{n}": ColwiseParallel() for n in "qkv"}
        plan |= {f"{b}.attn.o": row, f"{b}.mlp.fc": ColwiseParallel(),
                 f"{b}.mlp.proj": row}
    if sp:
        plan["ln_f"] = SequenceParallel()
        plan["head"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    return plan


class TorchTP(Strategy):
    name = "tp-torch"
    any_model = False  # distlab's GPT only (Strategy.any_model)
    books_all_traffic = False  # torch sends bytes of its own
    degrees = frozenset({"tp"})
    supports = Strategy.supports | {"sp"}

    def wrap(self, model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module
        self.mesh = init_device_mesh("cpu", (self.world,))
        return parallelize_module(model, self.mesh,
                                  torch_tp_plan(len(model.blocks), self.cfg.sp))

    def batch(self, data, step: int):
        return data.global_batch(step, self.cfg.global_batch)  # every TP rank: whole batch

    def build_optimizer(self, model, make):
        # DTensor and plain parameters in separate groups (foreach kernels take one kind)
        from torch.distributed.tensor import DTensor
        ps = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in ps if isinstance(p, DTensor)]},
                  {"params": [p for p in ps if not isinstance(p, DTensor)]}]
        return make([g for g in groups if g["params"]])

    def state_bytes(self, model, optimizer) -> dict:
        from torch.distributed.tensor import DTensor

        def local(t):
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()
        params = sum(local(p) for p in model.parameters())
        grads = sum(local(p.grad) for p in model.parameters() if p.grad is not None)
        optim = sum(local(v) for s in optimizer.state.values() for v in s.values()
                    if hasattr(v, "numel") and v.dim() > 0)
        return {"params": params, "grads": grads, "optim": optim}

    def clip_gradients(self, model, max_norm: float) -> float:
        import torch
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_state_dict(self, model) -> dict:
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                for k, v in model.state_dict().items()}
