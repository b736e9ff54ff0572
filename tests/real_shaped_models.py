"""Models shaped like the ones people train, written here (no new dependency), for
tests/test_real_shapes.py; a module, not a test file, so the ranks import it by name too.

NanoGPTLike     nanoGPT's layout: `transformer` an nn.ModuleDict (wte, wpe, drop, h, ln_f) that
                is never called, `h` an nn.ModuleList of blocks with a fused q|k|v projection
                (`c_attn`), an lm_head tied to wte, forward(idx, targets) -> (logits, loss)
TitanLike       torchtitan's Llama layout: `layers` an nn.ModuleDict of blocks keyed "0", "1"...
HFLike          a forward(input_ids, past_key_values=None, labels=None), as Hugging Face's
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
