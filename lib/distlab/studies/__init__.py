"""Studies: experiments that run in the notebook's own process, not in ranks. Mixed precision's
lessons (precision_lessons.py), FLOPs counted by PyTorch (flop_count.py), what a GPU adds
(gpu.py), and out of memory after hours: long sequences (long_sequences.py) against a memory
budget (memory_budget.py), graphs kept alive (leak.py), the CUDA allocator (fragmentation.py).

May import: everything but the workbook layer (lab/); nothing below imports them.
"""
