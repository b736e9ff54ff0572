"""distlab: the library behind the distributed-training workbook.

    from distlab import RunConfig, launch
    run = launch(RunConfig(strategy="allreduce", world_size=2, steps=50))
    run.wait().losses()
"""

from distlab.checkpoint import CheckpointError
from distlab.caller.resume import resume
from distlab.config import RunConfig
from distlab.caller.launch import launch, run_ranks
from distlab.caller.run import Run, RunError, RunStopped
from distlab.non_finite import NonFiniteError, detect_nan
from distlab.parallel.data_parallel.ddp import DistributedDataParallel
from distlab.parallel.zero.optimizer import ZeroOptimizer
from distlab.parallel.zero.fsdp import (MixedPrecisionPolicy, full_grad, fully_shard, grad_shard,
                                       replicate_gradients)
from distlab.parallel.tensor.tp import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                        SequenceParallel, full_state_dict, parallelize_module)
from distlab.parallel.pipeline.pp import PipelineSchedule
from distlab.parallel.context.api import ContextParallel
from distlab.models.moe import MoE
from distlab.parallel.expert.dispatch import (expert_parallel, expert_parallel_state_dict,
                                              reduce_expert_parallel_grads)

__all__ = ["RunConfig", "launch", "run_ranks", "Run", "RunError", "RunStopped", "resume",
           "CheckpointError", "DistributedDataParallel", "ZeroOptimizer", "fully_shard", "replicate_gradients",
           "MixedPrecisionPolicy", "grad_shard", "full_grad", "parallelize_module",
           "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "full_state_dict",
           "PipelineSchedule", "ContextParallel", "MoE", "expert_parallel",
           "reduce_expert_parallel_grads", "expert_parallel_state_dict", "detect_nan",
           "NonFiniteError"]
__version__ = "0.1.0"
