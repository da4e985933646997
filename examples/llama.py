"""A Llama-shaped decoder (RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP,
untied head) built from a plain config: no download, no ``transformers``.

Parameters are created in bf16 one module at a time (on the meta device first, then
materialized and initialized per layer), so building a model never holds an fp32 copy of it:
a 3B model needs its 6 GB of bf16 weights and no more.

    from llama import LlamaConfig, build
    model = build(LlamaConfig.preset("1b"), seed=0)
"""
from __future__ import annotations

import dataclasses
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "Llama", "build", "PRESETS"]


@dataclasses.dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 22
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def preset(cls, name: str, **overrides) -> "LlamaConfig":
        return cls(**{**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}})

    def num_parameters(self) -> int:
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = h // self.num_attention_heads * self.num_key_value_heads
        layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
        return self.num_hidden_layers * layer + 2 * v * h + h


#: Shapes of public models (vocabulary 32000): TinyLlama-1.1B, a 3.0B Llama (open_llama_3b's
#: width with grouped KV heads), Llama-2-7B; "100m" and "tiny" (the tests' smoke runs) are ours.
PRESETS: Dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                 num_attention_heads=12, num_key_value_heads=4, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32),
}


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rope(x, cos, sin):
    a, b = x[..., ::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        h, hd = c.hidden_size, c.hidden_size // c.num_attention_heads
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, hd
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(y).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(y).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, ids, labels=None):
        c = self.config
        t = ids.shape[1]
        hd = c.hidden_size // c.num_attention_heads
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(t, dtype=torch.float32), inv)
        cos, sin = ang.cos().to(self.lm_head.weight.dtype), ang.sin().to(self.lm_head.weight.dtype)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x)).float()
        if labels is None:
            return logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, c.vocab_size), labels[:, 1:].reshape(-1))


def build(c: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
          init: bool = True) -> Llama:
    """The model with ``dtype`` parameters, created module by module (never an fp32 copy of
    the whole model). ``init``: normal(0, 0.02) weights (norms at 1) from ``seed``, the same
    on every machine; False leaves them at zero (to be loaded)."""
    with torch.device("meta"):
        model = Llama(c)
    g = torch.Generator().manual_seed(seed)
    for name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            t = torch.zeros(p.shape, dtype=dtype)    # zeros: its pages are in RSS from here
            if init:
                if pname == "weight" and isinstance(mod, RMSNorm):
                    t.fill_(1.0)
                else:
                    t.normal_(0.0, 0.02, generator=g)
            mod._parameters[pname] = nn.Parameter(t)
    return model


def batch(step: int, c: LlamaConfig, batch_size: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Token ids of training step ``step`` (a function of the step only, so a resumed run
    sees the batches the uninterrupted one saw)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(c.vocab_size, (batch_size, seq), generator=g)


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
