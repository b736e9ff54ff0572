"""Training checkpoints: a run's whole state on disk, so that it can stop and go on exactly.

A checkpoint is one folder per save, named by the steps done:

    <checkpoint_dir>/step_000006/          checkpoint_dir "" means <run dir>/checkpoints
        meta.json        steps done, world size, strategy, format, the run's config, the torch
                         version, and each file's size, CRC-32 and writer rank. Written last:
                         a folder without it is not a checkpoint.
        state.pt         format "full": model, optimizer, loss scaler; rank 0 writes it
        dcp/             format "sharded": torch.distributed.checkpoint, one __<r>_0.distcp
                         per rank (its shard) plus .metadata (where each piece lives)
        rng/rank<r>.pt   every rank's random-number states (torch, CUDA, numpy, python)

Formats, by strategy:

    full     single, allreduce, ddp, ddp-torch: every rank holds the same model and optimizer,
             so rank 0 writes one copy and the others wait at a barrier. zero1-torch: torch's
             ZeroRedundancyOptimizer.consolidate_state_dict gathers its partitions on rank 0.
    sharded  zero1/2/3: each unit's flat shard of parameters and of optimizer state, saved as a
             DTensor slice Shard(0) of the unit's unpadded flat vector (our shard r is exactly
             DTensor's chunk r: both cut ceil(n/N) entries per rank), so DCP can cut it again
             for another world size. fsdp-torch: FSDP2's DTensor parameters and
             get_optimizer_state_dict's DTensor state. Every rank writes only its own shard.

Atomic: every rank writes into `.step_000006.tmp/` and fsyncs; rank 0 then writes meta.json,
fsyncs, renames the folder to `step_000006` (a rename within one filesystem is atomic) and
fsyncs the parent. A crash before the rename leaves a temporary that `list_checkpoints`
ignores; the previous checkpoint is untouched. (The ranks must share the filesystem, as a
cluster's shared storage.) "latest" is not a pointer file: it is the highest complete step_*
folder, found by scanning. resume_from="auto" takes the newest one whose files every rank
verified (sizes and CRC-32), with a warning naming the newer ones it skipped, so a damaged last
checkpoint costs the steps since the one before, not the job (under torchrun --max-restarts,
every restart would otherwise fail the same way). A save that fails in this rank's write (a
full disk: a CheckpointError saying "no space left on device") removes its temporary.

Saving: with checkpoint_every = k, after steps k-1, 2k-1, ... (0-based) and after the last
step, so a finished run can be extended (resume with a larger `steps`); keep_last complete
checkpoints stay. Resuming: the loop starts at steps_done. Data is a pure function of
(seed, step) (distlab.data.dataset) and a finite dataset's sampler position is a function of the step
(distlab.data.sampler), so the step is the data position.

What a resumed run may change is MAY_CHANGE (world size, steps, launch and logging knobs);
every other RunConfig field must match, and `check_compatible` names each one that does not.
Another world size: the sharded format re-cuts; the full format loads on any number of ranks;
a finite dataset's shards depend on the world size, so there it must stay.

Loading uses torch.load(..., weights_only=True): tensors and plain containers, no code. DCP's
own .metadata is a pickle that torch reads with pickle.load; its CRC-32 in meta.json is checked
first, which catches corruption, not forgery: load sharded checkpoints only from storage you
trust.

Preemption: with checkpoint_every > 0, SIGTERM is a notice (a spot instance's two-minute
warning, a scheduler's eviction, torchrun passing it on). At each step boundary the ranks agree
on whether any got one (a 4-byte all-reduce), then save and leave together; the run ends with
status "preempted". `Run.preempt(grace_s)` sends the notice and SIGKILLs after the grace.
`Run.stop()` sends the same SIGTERM, so a stopped checkpointing run saves before it leaves
(its SIGKILL follows 3 s later if a rank cannot reach a step boundary).

Where each part lives:

    store.py        the on-disk format: finding, verifying, reading and committing checkpoints,
                    and which configs may resume which (check_compatible)
    state.py        what a rank's state is made of besides its strategy's: RNG states, the
                    loss scaler (the strategy's side, DCP's flat-shard DTensors and buffers,
                    is distlab.parallel.state: checkpoint/ reads parallel/, never the reverse)
    preemption.py   SIGTERM as a preemption notice
    checkpointer.py the training loop's side: save when due, restore at the start
    async_save.py   checkpoint_async: the state staged (copied), then written by a thread while
                    training goes on; rank 0's thread commits once every rank's files are in
    distlab.caller.resume  the caller's side: launch a run again from its checkpoint

May import: the foundation, data/, models/, parallel/ and config. Never the reverse: what a
strategy hands over is distlab.parallel.state's.
"""

from distlab.checkpoint.checkpointer import Checkpointer
from distlab.checkpoint.store import (MAY_CHANGE, CheckpointError, check_compatible,
                                      checkpoint_root, latest_checkpoint, list_checkpoints,
                                      load_full, read_meta, verify)

__all__ = ["MAY_CHANGE", "CheckpointError", "Checkpointer", "check_compatible", "checkpoint_root",
           "latest_checkpoint", "list_checkpoints", "load_full", "read_meta", "verify"]
