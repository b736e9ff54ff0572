"""Plans: module name -> style. The GPT's plan as data (plan_table), as styles (gpt_plan) and
with shapes for a notebook (tp_plan), torchtitan-style: the model knows nothing about
parallelism; the plan replaces modules from outside by name. And Hugging Face's plans, which
name styles by string (HF_STYLES).
"""

from __future__ import annotations

from distlab.parallel.tensor.styles import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                            SequenceParallel)


# Hugging Face's tensor-parallel plans (a model's `base_model_tp_plan`) name styles by string;
# the ones with a distlab equivalent, relative to the base model as theirs are.


HF_STYLES = {"colwise": lambda: ColwiseParallel(), "rowwise": lambda: RowwiseParallel(),
             "sequence_parallel": lambda: SequenceParallel()}


def _from_string(pattern: str, style):
    if not isinstance(style, str):
        return style
    if style not in HF_STYLES:
        raise ValueError(f"plan[{pattern!r}] = {style!r}: of Hugging Face's style names distlab "
                         f"takes {', '.join(map(repr, HF_STYLES))}; for the others (gathered, "
                         "replicated or packed outputs) name a distlab style or leave the layer "
                         "out of the plan")
    return HF_STYLES[style]()


# -- the plan: module name -> style ------------------------------------------------------------


def plan_table(n_layer: int, sp: bool = False, experts: bool = False) -> dict:
    """Which module gets which treatment, by name (torchtitan-style). Styles:
    colwise / rowwise: replaced by Column/RowParallelLinear; region: its input passes the
    entry operator (f, or g_sp with sp) once, shared by q, k, v (or fc); sequence: replicated
    weights on a sequence-sharded input (sp only; gradient all-reduced); scatter_seq /
    gather_seq: where the residual stream enters / leaves the SP region. Modules not named
    (tok_emb, pos_emb, and without sp ln1, ln2, ln_f, head) stay replicated. experts: the
    blocks' MLPs are mixtures of experts, which stay whole on every tp rank (Megatron-Core's
    expert tensor parallel size 1): only attention is split."""
    plan = {}
    for i in range(n_layer):
        b = f"blocks.{i}"
        if sp:
            plan[f"{b}.ln1"] = "sequence"
        plan[f"{b}.attn"] = "region"
        plan |= {f"{b}.attn.{n}": "colwise" for n in "qkv"}
        plan[f"{b}.attn.o"] = "rowwise"
        if sp:
            plan[f"{b}.ln2"] = "sequence"
        if experts:
            continue
        plan[f"{b}.mlp"] = "region"
        plan[f"{b}.mlp.fc"] = "colwise"
        plan[f"{b}.mlp.proj"] = "rowwise"
    if sp:
        plan = {"blocks.0": "scatter_seq", **plan, "ln_f": "sequence", "head": "gather_seq"}
    return plan


def tp_plan(model, tp: int, sp: bool = False) -> list:
    """The plan as rows a notebook can show: (module, style, full shape, this rank's shape)."""
    rows = []
    for name, style in plan_table(len(model.blocks), sp).items():
        m = model.get_submodule(name)
        full = tuple(m.weight.shape) if hasattr(m, "weight") and m.weight is not None else None
        local = full
        if style == "colwise":
            local = (full[0] // tp, full[1])
        elif style == "rowwise":
            local = (full[0], full[1] // tp)
        rows.append((name, style, full, local))
    return rows


def gpt_plan(n_layer: int, sp: bool = False, experts: bool = False) -> dict:
    """plan_table as parallelize_module's plan. Without sp "region" rows need no style: the
    column-parallel layers that read one input share their entry f (q, k, v: one all-reduce
    backward); with sp the region's module gathers the sequence (g_sp) for its layers."""
    styles = {"colwise": ColwiseParallel,
              "rowwise": lambda: RowwiseParallel(output_layout="sequence" if sp else "replicate"),
              "sequence": SequenceParallel,
              "region": lambda: PrepareModuleInput("sequence", "replicate"),
              "scatter_seq": lambda: PrepareModuleInput("replicate", "sequence"),
              "gather_seq": lambda: PrepareModuleInput("sequence", "replicate",
                                                       use_local_output=True)}
    return {name: styles[style]() for name, style in plan_table(n_layer, sp, experts).items()
            if sp or style != "region"}
