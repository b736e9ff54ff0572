"""Models shaped like the ones people train, written here (no new dependency), for
tests/test_real_shapes.py; a module, not a test file, so the ranks import it by name too.

NanoGPTLike     nanoGPT's layout: `transformer` an nn.ModuleDict (wte, wpe, drop, h, ln_f) that
                is never called, `h` an nn.ModuleList of blocks with a fused q|k|v projection
                (`c_attn`), an lm_head tied to wte, forward(idx, targets) -> (logits, loss)
TitanLike       torchtitan's Llama layout: `layers` an nn.ModuleDict of blocks keyed "0", "1"...
HFLike          a forward(input_ids, past_key_values=None, labels=None), as Hugging Face's
GPT2Like        Hugging Face GPT-2's Conv1D layers (a Linear whose weight is stored in x out),
                its fused q|k|v `c_attn` split by `split_size` into heads of `head_dim`
LlamaLike       Hugging Face Llama's separate q/k/v/o and gate/up/down projections, attention
                that reshapes by head_dim (so a rank's share of the heads just works), and
                the model's own tensor-parallel plan in Hugging Face's strings
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, T, WIDTH, HEADS = 32, 16, 32, 4


class Block(nn.Module):
    def __init__(self, d=WIDTH, heads=HEADS):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (t.view(B, L, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, L, d))
        return x + self.mlp(self.ln_2(x))


class NanoGPTLike(nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, WIDTH), wpe=nn.Embedding(T, WIDTH), drop=nn.Dropout(0.0),
            h=nn.ModuleList(Block() for _ in range(layers)), ln_f=nn.LayerNorm(WIDTH)))
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT's

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1),
                                                             targets.flatten())
        return logits, loss


class TitanLike(nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.norm, self.output = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens, targets):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return F.cross_entropy(self.output(self.norm(h)).flatten(0, 1), targets.flatten())


class HFLike(NanoGPTLike):
    def forward(self, input_ids, past_key_values=None, labels=None):
        return super().forward(input_ids, labels)


class Conv1D(nn.Module):
    """Hugging Face's Conv1D as GPT-2 uses it: y = x @ W + b, W stored (nx, nf); nf = out."""
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return y.view(*x.shape[:-1], self.nf)


class GPT2MLP(nn.Module):
    def __init__(self, d=WIDTH):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(4 * d, d), Conv1D(d, 4 * d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPT2Attention(nn.Module):
    """GPT-2's: one fused Conv1D for q|k|v, split by `split_size`, heads by `head_dim`."""
    def __init__(self, d=WIDTH, heads=HEADS):
        super().__init__()
        self.split_size, self.head_dim = d, d // heads
        self.c_attn, self.c_proj = Conv1D(3 * d, d), Conv1D(d, d)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        q, k, v = (t.view(*t.shape[:-1], -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(*x.shape[:-1], -1))


class GPT2Like(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.h = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(WIDTH), attn=GPT2Attention(), ln=nn.LayerNorm(WIDTH),
            mlp=GPT2MLP())) for _ in range(layers))
        self.ln_f = nn.LayerNorm(WIDTH)

    def forward(self, input_ids, labels):
        x = self.wte(input_ids)
        for block in self.h:
            x = x + block.attn(block.ln_1(x))
            x = x + block.mlp(block.ln(x))
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied head, as GPT-2's
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class LlamaAttention(nn.Module):
    def __init__(self, d=WIDTH, heads=HEADS):
        super().__init__()
        self.head_dim = d // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        B, L, _ = x.shape
        shape = (B, L, -1, self.head_dim)  # -1: the heads this rank holds
        q, k, v = (p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj,
                                                                 self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, -1))


class LlamaMLP(nn.Module):
    def __init__(self, d=WIDTH):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d,
                                                                                bias=False)
        self.down_proj = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLike(nn.Module):
    # the shape of transformers' LlamaModel.base_model_tp_plan: module patterns -> strings
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise"}

    def __init__(self, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            input_layernorm=nn.LayerNorm(WIDTH), self_attn=LlamaAttention(),
            post_attention_layernorm=nn.LayerNorm(WIDTH), mlp=LlamaMLP()))
            for _ in range(layers))
        self.norm, self.lm_head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = h + layer.self_attn(layer.input_layernorm(h))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.lm_head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def nanogpt(cfg):
    torch.manual_seed(cfg.seed)
    return NanoGPTLike()


def titan(cfg):
    torch.manual_seed(cfg.seed)
    return TitanLike()


def hf_like(cfg):
    torch.manual_seed(cfg.seed)
    return HFLike()


class Shifted:
    """Token windows whose next token is a fixed function of the current one: learnable."""
    def global_batch(self, step, batch):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (batch, T), generator=g)
        return x, (3 * x + 1) % VOCAB


def tokens():
    return Shifted()


def nanogpt_one_unit(cfg):
    """nanoGPT declaring its own units, as a model declares tp_plan: here all of it in one."""
    model = nanogpt(cfg)
    model.fsdp_units = [["transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"]
                        + [f"transformer.h.{i}" for i in range(4)]]
    return model
