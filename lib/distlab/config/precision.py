"""RunConfig's precision section: autocast, loss scaling (distlab.rank.precision) and zero3's
mixed-precision policy (distlab.parallel.zero.fsdp.MixedPrecisionPolicy)."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.config.declare import Feature, Widget, declare
from distlab.units import DTYPES

# "fp32", "bf16", "fp16" (autocast's, distlab.units) and "fp8" (distlab.rank.fp8_linear)
PRECISIONS = tuple(DTYPES) + ("fp8",)
FP8_SCALINGS = ("tensorwise", "rowwise", "blockwise")  # distlab.rank.fp8_linear
FP8_GRAD_FORMATS = ("e5m2", "e4m3")
LOSS_SCALES = ("auto", "dynamic", "none")  # auto: dynamic for fp16, none otherwise


def loss_scaling(cfg) -> bool:
    """Whether cfg asks for dynamic loss scaling (the feature "loss_scaling")."""
    return cfg.loss_scale == "dynamic" or (cfg.loss_scale == "auto" and cfg.precision == "fp16")


@dataclass
class Precision:
    """Number formats: the compute dtype under autocast (fp32 master weights), dynamic loss
    scaling, modules kept in fp32, and zero3's parameter and reduction dtypes."""

    precision: str = declare("fp32", "compute dtype under autocast; the weights stay fp32",
                             choices=PRECISIONS, widget=Widget("precision"))
    fp8_scaling: str = declare(
        "tensorwise", "fp8: the groups sharing a scale (blockwise: DeepSeek-V3's 1x128 tiles "
        "and 128x128 weight blocks)", choices=FP8_SCALINGS,
        feature=Feature("fp8", "precision='fp8' (the linear layers in FP8)",
                        asks=lambda cfg: cfg.precision == "fp8"))
    fp8_grad_format: str = declare("e5m2", "fp8: the gradients' format (e5m2: range; e4m3: "
                                   "precision, as DeepSeek-V3)", choices=FP8_GRAD_FORMATS)
    fp8_all_gather: bool = declare(
        False, "zero3 with precision='fp8' (tensorwise): the FP8 Linears' weights all-gathered "
        "in e4m3, one scale each", widget=Widget("fp8 all-gather", kind="check"))
    loss_scale: str = declare(
        "auto", "dynamic loss scaling (auto: dynamic for fp16, none otherwise)",
        choices=LOSS_SCALES,
        feature=Feature("loss_scaling", "dynamic loss scaling (fp16, or loss_scale='dynamic')",
                        asks=loss_scaling))
    loss_scale_init: float = declare(65536.0, "dynamic: the first scale (torch GradScaler's: "
                                     "2**16)")
    loss_scale_growth_interval: int = declare(2000, "dynamic: clean steps before the scale "
                                              "doubles", at_least=1)
    fp32_modules: str = declare("", "comma-separated module names kept in fp32 under autocast")
    # zero3's mixed-precision policy (as FSDP2's): parameters cast to param_dtype before the
    # all-gather and computed in it; gradients reduce-scattered in reduce_dtype; fp32 master
    # shards
    param_dtype: str = declare("fp32", "zero3: parameters cast to this before the all-gather "
                               "and computed in it", choices=tuple(DTYPES),
                               widget=Widget("param dtype"))
    reduce_dtype: str = declare("", "zero3: gradients reduce-scattered in this ('': "
                                "param_dtype)", choices=("",) + tuple(DTYPES),
                                widget=Widget("reduce dtype", labels=(("", "as param dtype"),)))

    def check(self) -> None:
        if self.fp8_all_gather and (self.precision, self.fp8_scaling) != ("fp8", "tensorwise"):
            raise ValueError("fp8_all_gather sends the FP8 Linears' weights with one scale each, "
                             "the one their tensorwise cast takes: it needs precision='fp8' and "
                             f"fp8_scaling='tensorwise' (got {self.precision!r}, "
                             f"{self.fp8_scaling!r})")
        if self.fp8_all_gather and self.param_dtype != "fp32":
            raise ValueError(f"fp8_all_gather with param_dtype={self.param_dtype!r}: the weights "
                             "travel in one or the other; pick one")
        if self.param_dtype != "fp32" and self.precision not in ("fp32", "fp8"):
            raise ValueError(f"param_dtype={self.param_dtype!r} is zero3's mixed precision "
                             f"(parameters cast before the all-gather); precision="
                             f"{self.precision!r} is autocast: pick one (precision='fp32')")
        if self.precision != "fp8" and (self.fp8_scaling, self.fp8_grad_format) != (
                "tensorwise", "e5m2"):
            raise ValueError(f"fp8_scaling and fp8_grad_format are settings of precision='fp8';"
                             f" precision={self.precision!r} would ignore them")
        if not self.loss_scale_init > 0:
            raise ValueError(f"loss_scale_init={self.loss_scale_init} must be > 0")
