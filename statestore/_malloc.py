"""glibc's mmap threshold, fixed once per process by the parts of statestore that bound RAM.

glibc serves an allocation of at least its *mmap threshold* (128 KiB at start) with a
mapping of its own, given back to the system when freed; but each time such a block is freed
it raises the threshold to that block's size (up to 32 MiB) and the heap's trim threshold to
twice that. From then on blocks of up to that size come from the heap, where freed ones stay
resident until the top of the heap exceeds the trim threshold. Training makes and frees
blocks of every size from 128 KiB to 32 MiB each step (activations, gradients, FSDP2's
all-gather and reduce-scatter buffers), so the process's RSS climbs above its working set:
measured under FSDP2 (2 ranks, 106M parameters, ``benchmarks/fsdp2.py``), about 1 GiB per
rank over the working set within 8 steps, in torch's AdamW in RAM as with a disk store;
with parameter offload on a 24-layer model of 4 MiB layers, about 60 MiB.

Keeping optimizer states on disk (or parameters: ``offload_parameters``) is done to bound
RAM, so an optimizer over a disk store and the offload handle fix the threshold at 1 MiB
(``mallopt(M_MMAP_THRESHOLD)``, which also stops the adjustment): every block of 1 MiB or
more is a mapping again, given back when freed. Process-wide, once; ``STATESTORE_MALLOPT=0``
in the environment leaves malloc alone (as does a C library other than glibc). The cost: a
block of 1 MiB or more is mapped and its pages faulted in at each allocation (torch's CPU
allocator keeps no cache): FSDP2 on the CPU took about 1.6x the CPU seconds a step
(benchmarks/RESULTS.md, "FSDP2: per-rank RSS once the fixed costs were cut").
"""
from __future__ import annotations

import os

__all__ = ["fix_mmap_threshold", "MMAP_THRESHOLD"]

#: the threshold set (bytes)
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3          # glibc's mallopt parameter
_done = False


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (see the module docstring), once
    per process, unless ``STATESTORE_MALLOPT=0``.

    Returns:
        Whether this call set it (False: done before, opted out, or not glibc).
    """
    global _done
    if _done or os.environ.get("STATESTORE_MALLOPT", "1") == "0":
        return False
    _done = True
    try:
        import ctypes
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):       # not glibc
        return False
