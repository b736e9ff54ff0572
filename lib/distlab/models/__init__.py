"""Models the workbook trains: plain model code, parallelised from outside."""

from distlab.models.gpt import GPT, GPTConfig, gpt_param_count

__all__ = ["GPT", "GPTConfig", "gpt_param_count"]
