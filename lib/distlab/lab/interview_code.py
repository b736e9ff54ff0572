"""Code that interview answers quote, run as quoted: does it do what the answer says?

Each snippet runs in a fresh Python process (a process group, once made, cannot be unmade in
the notebook's own): its outcome is what the process printed last, an exception's type and
message, or its last line of output. `claim_rows()` turns them into claims rows whose claim is
the answer's statement and whose verdict is computed from the run (they read "no" where the
code does not run as the answer says).

What cannot run here is said, and the nearest thing that can is run instead: FSDP1 refuses
to start without an accelerator on this machine (after Python has bound its arguments, so an
unknown keyword is still refused first, as on a GPU), so for `sharding_strategy="FULL_SHARD"`
the table FSDP looks the strategy up in is read (`_init_utils.SHARDING_STRATEGY_MAP`, keyed
by the ShardingStrategy enum); DeepSpeed is not installed, so its quoted import is compiled,
and the block that quotes `DeepSpeed.initialize` is run whole, as quoted: it stops at its first
line, before the call, and says whether deepspeed is installed. With the import fixed, the call
would still need DeepSpeed (`deepspeed.initialize`, which returns a tuple), which this machine
does not have and cannot download: that part is not run here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PG = ("import os, torch, torch.distributed as dist\n"
       "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(__import__('socket')"
       ".create_server(('127.0.0.1', 0)).getsockname()[1]))\n")

# E3's offloading step, as the question set's answer quotes it (run whole: exec'd as a file)
_DEEPSPEED_BLOCK = """from deepspeed. import DeepSpeed

# Offload optimizer states to CPU
config = {
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"}
    }
}

model_engine = DeepSpeed.initialize(model=model, config=config)
"""

SNIPPETS = {
    "timeout": (
        "`init_process_group(..., timeout=1800)` sets a 30-minute timeout",
        _PG + "dist.init_process_group('gloo', rank=0, world_size=1, timeout=1800)\n"
              "print('a process group with timeout=1800')"),
    "fsdp_string": (
        "`FSDP(model, sharding_strategy=\"FULL_SHARD\")` shards the model (ZeRO-3)",
        "from torch.distributed.fsdp._init_utils import SHARDING_STRATEGY_MAP\n"
        "print(SHARDING_STRATEGY_MAP['FULL_SHARD'])"),
    "fsdp_checkpointing": (
        "`FSDP(model, ..., activation_checkpointing=True)` turns on activation checkpointing",
        _PG + "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
              "dist.init_process_group('gloo', rank=0, world_size=1)\n"
              "FSDP(torch.nn.Linear(2, 2), activation_checkpointing=True)\n"
              "print('FSDP took activation_checkpointing')"),
    "deepspeed_import": (
        "`from deepspeed. import DeepSpeed` imports DeepSpeed's offloading",
        "compile('from deepspeed. import DeepSpeed', '<the answer>', 'exec')\n"
        "print('it compiles')"),
    "deepspeed_initialize": (
        "`model_engine = DeepSpeed.initialize(model=model, config=config)` offloads the "
        "optimizer state to CPU (its whole block, `from deepspeed. import DeepSpeed` first)",
        "import importlib.util, torch\n"
        "model = torch.nn.Linear(2, 2)  # the answer's `model`\n"
        f"QUOTED = {_DEEPSPEED_BLOCK!r}\n"
        "try:\n"
        "    exec(compile(QUOTED, '<the answer>', 'exec'))\n"
        "except SyntaxError as e:\n"
        "    installed = importlib.util.find_spec('deepspeed') is not None\n"
        "    raise SystemExit(f'SyntaxError: {e.msg} (<the answer>, line {e.lineno}): the block '\n"
        "                     'stops before DeepSpeed.initialize runs; deepspeed installed here: '\n"
        "                     f'{installed}')\n"
        "print(type(model_engine).__name__)"),
    "launch": (
        "`python -m torch.distributed.launch --nproc_per_node=4 train.py` is the way to launch",
        "import subprocess, sys\n"
        "p = subprocess.run([sys.executable, '-m', 'torch.distributed.launch', '--help'],\n"
        "                   capture_output=True, text=True)\n"
        "warn = [l for l in p.stderr.splitlines() if 'deprecated' in l.lower()]\n"
        "print(warn[0].split('Warning: ')[-1] if warn else 'no deprecation warning')"),
}


def run(code: str, timeout_s: float = 120) -> dict:
    """Run `code` in a fresh interpreter: {"ok": it exited 0, "said": its last words}."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout_s)
    lines = [line.strip() for line in (proc.stderr if proc.returncode else proc.stdout)
             .splitlines() if line.strip()]
    said = lines[-1] if lines else ""
    return {"ok": proc.returncode == 0, "said": said.removeprefix("[rank0]: ")[:300]}


def run_all(names=None) -> dict:
    return {n: run(SNIPPETS[n][1]) for n in (names or SNIPPETS)}


def holds(name: str, outcome: dict) -> bool:
    """Whether the run supports the answer's statement."""
    if name == "launch":  # it runs; the question is whether PyTorch still means it
        return outcome["ok"] and "deprecated" not in outcome["said"].lower()
    return outcome["ok"]


def claim_rows(outcomes: dict) -> list[dict]:
    """Claims rows: the answer's statement, what the run said, the verdict."""
    from distlab.lab.common import claim
    return [claim(f"{SNIPPETS[n][0]} (an interview answer's code)",
                  "the question sets' answers, run as quoted",
                  f"ran in a fresh Python: {o['said'] or 'no output'}", holds(n, o))
            for n, o in outcomes.items()]
