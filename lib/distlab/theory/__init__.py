"""The formulas: every predicted byte, FLOP and memory figure a notebook sets beside a
measurement, each with its source named. No process runs here.

    estimate.py      memory per rank: the ZeRO paper's model states, Korthikanti et al.'s
                     activations, exact byte counts for this project's runs
    zero_memory.py   DeepSpeed's ZeRO-2/3 memory estimators, reproduced
    comm_bytes.py    bytes each strategy sends per step: ZeRO/FSDP, Megatron TP, the 3D mesh
    flops.py         6N + 12·L·h·s per token, datasheet peaks
    plan.py          the planner: dp × tp × pp × ZeRO layouts, memory and time per layout

May import: the foundation, data/, models/, parallel/ (what a strategy declares) and config.
"""
