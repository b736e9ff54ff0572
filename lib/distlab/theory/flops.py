"""FLOPs and peaks by formula: a training step's model FLOPs per token, and the datasheet peak
of the GPUs MFU is measured against.

    matmul_params(cfg)                the GPT's parameters that multiply activations
    train_flops_per_token(cfg)        6N + 12·L·h·s
    datasheet_peak(name, precision)   (FLOP/s, source) for the GPUs listed (bf16, fp32, fp8)

distlab.studies.flop_count sets the formula beside what PyTorch's FLOP counter counts on a real
step; distlab.studies.gpu divides a measured FLOP/s by the peak (MFU).

**FLOPs of a training step.** Each parameter that multiplies an activation costs 2 FLOPs per
token forward and 4 backward: 6N per token (Kaplan et al. 2020, "Scaling Laws for Neural
Language Models", Section 2.1, C ≈ 6N per token). Attention's two s×s matmuls (QKᵀ and the
weights times V) add 2·2·s·h per layer per token forward, 3x that with backward: 12·L·h·s
(Chowdhery et al. 2022, PaLM, Appendix B: 6N + 12·L·H·Q·T; nanoGPT's `estimate_mfu` uses the
same). Both count the full s×s, though a causal flash kernel skips about half of it; we do as
they do, so MFU figures compare with theirs. N here counts the parameters that multiply:
every Linear (q, k, v, o, the MLP, the untied head), not the embedding tables (lookups) nor
LayerNorms and biases (elementwise).

**MFU** (model FLOP utilisation, PaLM Appendix B) = achieved model FLOP/s / the GPU's peak.
The peaks are the datasheets' dense figures (their headline bf16 figures are "with
sparsity", twice the dense ones):

    NVIDIA H100 Tensor Core GPU datasheet:  SXM  bf16 989 TFLOP/s, fp32 67, fp8 1979
                                            PCIe bf16 756,        fp32 51, fp8 1513
                                            NVL  bf16 835,        fp32 60, fp8 1671
    NVIDIA H200 Tensor Core GPU datasheet:  SXM  bf16 989,        fp32 67, fp8 1979
                                            NVL  bf16 835,        fp32 60, fp8 1671

(fp8: the sheets' FP8 Tensor Core figures, 3958, 3026 and 3341 "with sparsity", halved.)

fp32 runs here use torch's default, TF32 matmuls off (torch.backends.cuda.matmul.allow_tf32 is
False), so the fp32 peak is the non-tensor-core FP32 figure.
"""

from __future__ import annotations

H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet (dense; the sheet's bf16 is with sparsity)"
H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet (dense; the sheet's bf16 is with sparsity)"
# (substring of torch.cuda.get_device_name(), TFLOP/s bf16, fp32, fp8, source); the first
# match wins, so the more specific names come first
PEAKS = (
    ("H200 NVL", 835.0, 60.0, 1670.5, H200_SHEET),
    ("H200", 989.0, 67.0, 1979.0, H200_SHEET),
    ("H100 NVL", 835.0, 60.0, 1670.5, H100_SHEET),
    ("H100 PCIe", 756.0, 51.0, 1513.0, H100_SHEET),
    ("H100", 989.0, 67.0, 1979.0, H100_SHEET),  # SXM5: "NVIDIA H100 80GB HBM3"
)


def datasheet_peak(device_name: str, precision: str) -> tuple[float, str] | None:
    """(peak FLOP/s, source) of `precision` ("bf16", "fp32" or "fp8") on the GPU named, or
    None."""
    for key, bf16, fp32, fp8, source in PEAKS:
        if key.lower() in device_name.lower():
            tflops = {"bf16": bf16, "fp32": fp32, "fp8": fp8}.get(precision)
            return (tflops * 1e12, source) if tflops else None
    return None


def matmul_params(cfg) -> int:
    """Parameters of our GPT that multiply activations: per layer q, k, v, o (4h²) and the MLP
    (2rh²), and the untied head (hV)."""
    h, r = cfg.n_embd, cfg.mlp_ratio
    return cfg.n_layer * (4 * h * h + 2 * r * h * h) + h * cfg.vocab_size


def train_flops_per_token(cfg) -> int:
    """6N + 12·L·h·s: a training step's model FLOPs per token (module docstring)."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len
