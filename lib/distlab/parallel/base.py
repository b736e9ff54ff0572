"""What a strategy is, and the plug points it may override.

What it is, declared on the class (RunConfig and the checkpoints read these; nothing else
compares strategy names):

    name                    the RunConfig.strategy value (its line in distlab.parallel.REGISTRY)
    degrees                 the model-parallel degrees it reads: "tp", "pp" (RunConfig.tp, .pp)
    layouts(world_size)     the (tp, pp) it runs at that world size, preferred first
    knobs                   the RunConfig fields only some strategies read that it reads
                            (distlab.parallel.KNOBS is built from these)
    supports                optional features it implements (each asked for by a RunConfig
                            field that declares it: distlab.config.FEATURES)
    checkpoint_layout       strategies with the same layout read each other's checkpoints;
                            None: this strategy does not checkpoint
    checkpoint_format       "full" (rank 0 writes one copy) or "sharded" (a DCP shard per rank)
    servers, replicated,    ranks that serve instead of training; whether every rank holds the
    zero_stage              whole model state; ZeRO's stage (what the memory estimator reads)
    dp_degree(cfg)          how many ranks split one global batch
    processes(cfg)          how many processes to launch
    check_config(cfg)       its own checks of a RunConfig, before any process starts
    mesh_preset(cfg)        the same run as degrees of the `mesh` strategy (RunConfig.as_mesh;
                            tests/test_mesh.py trains the two side by side), or None where the
                            mesh has no equivalent (threads, servers, torch's twins, DiLoCo)

The defaults are a plain single-process step.

The loop in distlab.rank.train calls, in order:

    model = strategy.wrap(model)                       once
    optimizer = strategy.build_optimizer(model, make)  once
    if strategy.is_server(): strategy.serve(...)        instead of training (parameter server)
    per step:  x, y = strategy.batch(data, step)        this rank's rows (None: out of data)
               with strategy.no_sync(model): backward   every micro-batch but the last
               strategy.reduce_gradients(model)
               strategy.step_gradients(model)           what loss scaling unscales and checks
               strategy.clip_gradients(model, max_norm) cfg.grad_clip > 0 (after unscaling)
               strategy.optimizer_step(optimizer)       skipped when loss scaling overflowed
               strategy.step_info()                     extra fields for the step event
    checkpoints (distlab.checkpoint): strategy.checkpoint_state / load_checkpoint_state

Composite strategies (distlab.parallel.mesh's 3d) build their parts on their groups' Comms and
call the parts' public hook (after_model_split) and plug points.
"""

from __future__ import annotations

import contextlib

import torch


# The model-parallel degrees a strategy may declare in `degrees` (RunConfig fields of these names)
DEGREES = ("tp", "pp")


class Strategy:
    name = ""
    degrees: frozenset = frozenset()
    knobs: frozenset = frozenset()
    supports: frozenset = frozenset({"grad_clip", "loss_scaling"})
    checkpoint_layout: str | None = None
    checkpoint_format = "full"
    servers = 0  # ranks that serve instead of training (a parameter server: rank 0)
    # model states per rank, for the estimator (distlab.theory.estimate.run_model_state_bytes):
    replicated = False  # every rank holds the whole model, its gradients and optimizer state
    zero_stage = 0  # ZeRO's partitioning over padded flat buffers: 1, 2 or 3
    # False where torch's own code sends bytes that Comm does not book (DDP's buffer broadcast,
    # ZeroRedundancyOptimizer, FSDP2, DTensor, pipelining): the step's wire bytes that no
    # measured call explains are then labelled "not booked" (distlab.wire.Ledger)
    books_all_traffic = True
    # False where the strategy reaches into distlab's GPT (its layer names, its logits): it
    # cannot run a model of your own (RunConfig.model="package.module:function")
    any_model = True

    @classmethod
    def mesh_preset(cls, cfg) -> dict | None:
        """The mesh's degrees (and ZeRO stage) that train what this strategy trains."""
        return None

    @classmethod
    def dp_degree(cls, cfg) -> int:
        """Ranks that split one global batch: the world over the model-parallel degrees."""
        tp = cfg.tp if "tp" in cls.degrees else 1
        pp = cfg.pp if "pp" in cls.degrees else 1
        return cfg.world_size // (tp * pp)

    @classmethod
    def layouts(cls, world_size: int) -> list[dict]:
        """The model-parallel degrees {"tp": t, "pp": p} this strategy runs at world_size,
        preferred first (RunConfig refuses any other; a control panel offers these). A degree
        the strategy does not read is 1. One degree read: it spans the world (tp: tp = world,
        pp: pp = world). Both (a mesh, world = dp x tp x pp): every t x p dividing the world,
        those splitting the model both ways first, then the most model-parallel ranks."""
        if cls.degrees and set(cls.degrees) != set(DEGREES):
            return [{d: world_size if d in cls.degrees else 1 for d in DEGREES}]
        if not cls.degrees:
            return [{"tp": 1, "pp": 1}]
        pairs = [(t, p) for t in range(1, world_size + 1) for p in range(1, world_size + 1)
                 if world_size % (t * p) == 0]
        pairs.sort(key=lambda tp: (-(tp[0] > 1) - (tp[1] > 1), -tp[0] * tp[1], -tp[0]))
        return [{"tp": t, "pp": p} for t, p in pairs]

    @classmethod
    def processes(cls, cfg) -> int:
        return cfg.world_size

    @classmethod
    def check_config(cls, cfg) -> None:
        """Raise ValueError for a config this strategy cannot run (after RunConfig's own checks,
        which already refused the features it does not declare)."""

    def __init__(self, cfg, comm):
        self.cfg, self.comm = cfg, comm
        self.rank, self.world = comm.rank, comm.world
        self.log = None  # the rank's EventLog, set by the loop

    def wrap(self, model):
        """Prepare the model (for example, make every rank start from rank 0's weights)."""
        return model

    def after_model_split(self, model) -> None:
        """Composition hook: a composite (3d) changed the model after this strategy wrapped it
        (a pipeline kept some blocks; ZeRO re-pointed parameters into its flat buffers). Bring
        what this strategy remembers about the model up to date. Default: nothing kept."""

    def build_optimizer(self, model, make):
        """The optimizer over what this rank updates; `make(params)` builds RunConfig's
        optimizer. ZeRO overrides this to own only its shard of the optimizer state."""
        return make([p for p in model.parameters() if p.requires_grad])

    def is_server(self) -> bool:
        """True on a rank that serves (a parameter server) instead of training."""
        return False

    def serve(self, model, optimizer):
        raise NotImplementedError

    def batch(self, data, step: int):
        """This rank's rows of the step's global batch; None when this rank is out of data.
        Data-parallel default: rank r of N takes the r-th of N equal blocks."""
        return data.rank_batch(step, self.cfg.global_batch, self.rank, self.world)

    def out_of_data(self, model, step: int) -> bool:
        """Called when `batch` returned None. Return True to keep stepping without data (a
        join-style protocol shadowing the others' collectives), False to stop this rank."""
        return False

    def no_sync(self, model):
        """Context for the micro-batches before the last one of an optimizer step: gradients
        only accumulate locally; communication waits for the last micro-batch."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _hooks_paused(self):
        """no_sync for strategies that communicate from gradient hooks (ddp, zero*): the hooks
        read self._sync and only let gradients accumulate while it is False."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def forward_backward(self, model, x, y, scale_loss):
        """Own the step's forward and backward over all its micro-batches (a pipeline
        schedule). Return the loss to log (None on a rank that has none, e.g. a pipeline's
        non-last stage), or NotImplemented (the default) to let the loop run its own
        micro-batch loop. `scale_loss(loss)` applies loss scaling before backward."""
        return NotImplemented

    def reduce_gradients(self, model):
        """After backward: make the gradients the ones of the global batch."""

    def step_gradients(self, model) -> list:
        """After reduce_gradients: the gradient tensors this rank's optimizer step will read.
        The loss scaler unscales these in place and checks them for inf/NaN (distlab.rank.precision);
        a strategy that holds gradients elsewhere (ZeRO's shards) returns those."""
        return [p.grad for p in model.parameters() if p.grad is not None]

    def clip_gradients(self, model, max_norm: float) -> float:
        """Scale the gradients so their global L2 norm is at most max_norm; return the norm
        before clipping. A strategy with sharded gradients must sum the squares across ranks."""
        params = [p for p in model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def optimizer_step(self, optimizer):
        optimizer.step()

    def state_bytes(self, model, optimizer) -> dict:
        """Bytes of parameters, gradients and optimizer state this rank holds, measured after
        optimizer_step. Sharding strategies (ZeRO, FSDP) count their local shards instead."""
        from distlab.memory import model_state_bytes
        return model_state_bytes(model, optimizer)

    def full_state_dict(self, model) -> dict:
        """The whole model's weights under the names `single` uses (what equivalence tests
        compare). Strategies that shard parameters gather them; a collective for those. A
        wrapper's prefix (torch DDP's "module.") is dropped."""
        return {k.removeprefix("module."): v for k, v in model.state_dict().items()}

    def step_info(self) -> dict:
        """Extra fields for this step's event (bucket timeline, staleness, ...)."""
        return {}

    def routing_comms(self) -> list:
        """The groups whose ranks route different tokens through the same MoE layers, in
        turn: the experts' loads are summed over them before the balancing bias moves
        (distlab.models.moe.update_expert_bias). Data parallelism: every rank."""
        return [self.comm]

    def between_steps(self, model) -> None:
        """After a step is logged, evaluated and checkpointed, when another follows: start
        what the next step needs first (ZeRO-3: its first all-gathers)."""

    # -- training checkpoints (distlab.checkpoint) ----------------------------------------------
    def checkpoint_state(self, model, optimizer, for_load: bool = False) -> dict:
        """This rank's part of a training checkpoint. "full" format: the whole model's and
        optimizer's state (the default; rank 0 writes it). "sharded": this rank's shards as
        tensors DCP writes, and loads into in place (for_load: the tensors to fill). Called on
        every rank (a strategy may need a collective here)."""
        module = getattr(model, "module", model)  # torch DDP wraps the model
        return {"model": module.state_dict(), "optimizer": optimizer.state_dict()}

    def load_checkpoint_state(self, model, optimizer, state: dict) -> None:
        """Full format: load `state` (what checkpoint_state returned on rank 0). Sharded: DCP has
        filled checkpoint_state(for_load=True)'s tensors in place; finish what they feed."""
        module = getattr(model, "module", model)
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def checkpoint_meta(self, model) -> dict:
        """What meta.json records about this strategy's layout, to read it without the
        strategy (distlab.checkpoint.load_full)."""
        return {"units": []}

    # strategies that take a checkpoint of another layout (distlab.checkpoint.reshard) say so
    loads_canonical = False

    def load_canonical(self, model, optimizer, state: dict) -> None:
        """Load a checkpoint written under another layout, named per parameter
        (distlab.checkpoint.reshard.canonical): every tensor this rank's model holds, whole
        (a replica: all of them; a pipeline stage: its own)."""
        module = getattr(model, "module", model)
        mine = module.state_dict()
        missing = [k for k in mine if k not in state["model"]]
        if missing:
            raise KeyError(f"the checkpoint has no {', '.join(missing[:4])}")
        module.load_state_dict({k: state["model"][k] for k in mine})
        if state["optim"]:
            names = [n for n, p in module.named_parameters() if p.requires_grad]
            saved = optimizer.state_dict()
            saved["state"] = {i: {k: v.clone() for k, v in state["optim"][n].items()}
                              for i, n in enumerate(names)}
            optimizer.load_state_dict(saved)

    def trainable_order(self, model) -> list[str]:
        """The names of the parameters `single`'s optimizer steps, in its order: a replicated
        checkpoint's optimizer state is by index into them. This rank's model holds them all,
        unless a strategy splits it into stages."""
        return [n.removeprefix("module.") for n, p in model.named_parameters() if p.requires_grad]
