"""HF transformers Trainer with statestore: a small Llama (built from a config, nothing
downloaded) trains with HybridAdam whose states live on an NVMeStore (the Trainer builds it
from the TrainingArguments: ``state_store=``); the Trainer's
checkpoints save the optimizer through ``save_checkpoint`` (``checkpoint-N/statestore/``, hard
links of the store's files) instead of ``torch.save(optimizer.state_dict())``. A second
Trainer, in a fresh process, resumes from ``checkpoint-N`` and must end bit for bit where the
uninterrupted run ended.

    python examples/hf_trainer.py [--dir DIR] [--steps 12] [--save-at 6]

The two lines that differ from a plain Trainer script are marked ``# <- statestore``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import statestore as ss  # noqa: E402


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=256, seq=32):
        g = torch.Generator().manual_seed(1)
        self.rows = torch.randint(0, 512, (n, seq), generator=g)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def train(out_dir: str, store_dir: str, steps: int, save_at: int, resume: str = None):
    from transformers import TrainingArguments
    from statestore.integrations.transformers import StateStoreTrainer   # <- statestore

    model = make_model()
    store = ss.NVMeStore(store_dir)
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, save_steps=save_at,
                             learning_rate=1e-3, weight_decay=0.01, warmup_steps=4,
                             per_device_train_batch_size=4, logging_steps=save_at, report_to=[],
                             use_cpu=True, seed=7, disable_tqdm=True)
    trainer = StateStoreTrainer(model=model, args=args, train_dataset=Tokens(),  # <- statestore
                                state_store=store)
    trainer.train(resume_from_checkpoint=resume)
    store.close()
    return {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-at", type=int, default=6)
    ap.add_argument("--resume", default=None, help=argparse.SUPPRESS)    # the second process
    ap.add_argument("--weights-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.resume:
        save_file(train(os.path.join(a.dir, "out"), os.path.join(a.dir, "store-resumed"),
                        a.steps, a.save_at, resume=a.resume), a.weights_out)
        return
    with tempfile.TemporaryDirectory(prefix="hf_trainer-") as tmp:
        work = a.dir or tmp
        print(f"1) training {a.steps} steps, a checkpoint every {a.save_at} (in {work})")
        full = train(os.path.join(work, "out"), os.path.join(work, "store"), a.steps, a.save_at)
        ckpt = os.path.join(work, "out", f"checkpoint-{a.save_at}")
        print(f"   {ckpt}: {sorted(os.listdir(ckpt))}")
        print(f"2) a new process resumes from {ckpt}")
        weights = os.path.join(work, "resumed.safetensors")
        subprocess.run([sys.executable, __file__, "--dir", work, "--steps", str(a.steps),
                        "--save-at", str(a.save_at), "--resume", ckpt, "--weights-out", weights],
                       check=True)
        resumed = load_file(weights)
        same = all(torch.equal(full[n], resumed[n]) for n in full)
        print(f"3) resumed run == uninterrupted run, bit for bit: {same}")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
