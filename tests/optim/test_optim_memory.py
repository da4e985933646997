"""What an optimizer over a disk store adds to the process's RAM besides its ring: no module
loaded for checkpoints alone (pyarrow: ~28 MiB of RSS), and heap blocks given back to the
system when freed (glibc's mmap threshold fixed, statestore/_malloc.py). Run in a fresh
interpreter, where the module table and malloc's settings start clean."""
import subprocess
import sys

import pytest

from helpers.paths import env

_CODE = """
import os, sys, torch
import statestore as ss
from statestore.optim import HybridAdam

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def kept_after_free():
    # glibc raises its mmap threshold to a large block freed (16 MiB): 3 MiB blocks then
    # come from the heap, and stay resident once freed, unless the threshold is fixed
    t = torch.ones(16 << 20, dtype=torch.uint8); del t
    base = rss()
    blocks = [torch.ones(3 << 20, dtype=torch.uint8) for _ in range(8)]
    del blocks
    return (rss() - base) >> 20

before = kept_after_free()
store = ss.NVMeStore(sys.argv[1], budget_bytes=1 << 20)
m = torch.nn.Linear(8, 8)
opt = HybridAdam(m.named_parameters(), lr=0.1, state_store=store)
m(torch.ones(2, 8)).sum().backward()
opt.step(); store.sync()
print('pyarrow' in sys.modules, before, kept_after_free())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc")
def test_optimizer_over_a_disk_store_adds_no_module_and_no_resident_free_blocks(tmp_path):
    """pyarrow (the checkpoint manifest's format) loads on the first save or load, not when
    an optimizer is built and steps on a store with no checkpoint to resume. Before the
    optimizer exists, 24 MiB of freed 3 MiB blocks stay resident (glibc's default: the
    measure sees it); once it exists (over a disk store) they go back to the system."""
    r = subprocess.run([sys.executable, "-c", _CODE, str(tmp_path)], capture_output=True,
                       text=True, timeout=300, env=env())
    assert r.returncode == 0, r.stderr[-2000:]
    pyarrow, before, after = r.stdout.split()
    assert pyarrow == "False", "building and stepping the optimizer imported pyarrow"
    assert int(before) >= 16, f"control: glibc kept only {before} MiB of freed blocks"
    assert int(after) <= 4, f"{after} MiB of freed blocks stayed resident"


def test_ring_is_sized_to_states_smaller_than_the_budget(tmp_path):
    """The pipeline's host buffers (``stats()["buffer_bytes"]``, the RAM a disk store holds
    between steps) follow the states while they are smaller than ``budget_bytes``: 2 MiB of
    Adam states under a 256 MiB budget take a ring of about their size, and one step of a
    model whose states exceed the budget takes the budget, no more."""
    import torch

    import statestore as ss
    from statestore.optim import HybridAdam
    for width, budget in ((256, 256 << 20), (1024, 1 << 20)):
        store = ss.NVMeStore(str(tmp_path / str(width)), budget_bytes=budget)
        m = torch.nn.Linear(width, width, bias=False)
        opt = HybridAdam(m.named_parameters(), lr=0.1, state_store=store)
        m(torch.ones(2, width)).sum().backward()
        opt.step()
        store.sync()
        st = store.stats()
        assert st["nbytes"] == 2 * 4 * width * width
        assert st["buffer_bytes"] <= min(budget, st["nbytes"] + (1 << 20) + 4 * store.alignment)
        store.close()
