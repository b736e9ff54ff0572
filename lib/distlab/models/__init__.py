"""Models the workbook trains: plain model code, parallelised from outside. gpt.py (a tiny
nanoGPT-style GPT, blocks addressable by name), bnnet.py (a small BatchNorm net), and
factory.py: your own model and data, named by import path (RunConfig.model="pkg.mod:fn").

May import: the foundation and data/.
"""

from distlab.models.gpt import GPT, GPTConfig, gpt_param_count

__all__ = ["GPT", "GPTConfig", "gpt_param_count"]
