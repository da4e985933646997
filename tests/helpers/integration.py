"""Shared pieces of the tests/integrations/test_integrations_*.py: a tiny Llama built from a config (no
download), token data, a warmup schedule, and the stores each integration is tested on."""
from __future__ import annotations

import os

import torch

import statestore as ss

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

VOCAB = 128
SEQ = 16

#: (name, factory(tmp_path)): a disk store and a resident one.
STORES = {
    "nvme": lambda tmp: ss.NVMeStore(str(tmp), budget_bytes=1 << 20),
    "device-cpu": lambda tmp: ss.DeviceStore("cpu"),
}


def tiny_llama(seed: int = 0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.model.embed_tokens.weight.requires_grad_(False)       # a frozen embedding
    return model


def token_batches(n: int, batch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(n)]


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(0, VOCAB, (SEQ,), generator=g) for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def param_groups(model, lr=3e-3):
    """Two groups (decay / no decay) of named trainable parameters."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [(n, p) for n, p in named if p.ndim >= 2]
    rest = [(n, p) for n, p in named if p.ndim < 2]
    return [{"params": [p for _, p in decay], "param_names": [n for n, _ in decay],
             "weight_decay": 0.1},
            {"params": [p for _, p in rest], "param_names": [n for n, _ in rest],
             "weight_decay": 0.0}]


#: the optimizers the integrations are tested with: statestore's Adam, and any torch
#: optimizer through StoreOptimizer (Adafactor: whole-tensor units, a tuple hyperparameter)
KINDS = ("hybrid", "adafactor")


def make_optimizer(model, store, lr=3e-3, kind="hybrid"):
    if kind == "adafactor":
        from statestore.optim import StoreOptimizer
        return StoreOptimizer(torch.optim.Adafactor, param_groups(model), lr=lr,
                              state_store=store)
    from statestore.optim import HybridAdam
    return HybridAdam(param_groups(model), lr=lr, betas=(0.9, 0.95), state_store=store)


def warmup(opt, warm: int = 4):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_params(a, b):
    assert a.keys() == b.keys()
    diff = [n for n in a if not torch.equal(a[n], b[n])]
    assert not diff, f"parameters differ after resume: {diff[:5]}"
