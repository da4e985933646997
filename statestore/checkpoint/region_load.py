"""Loading regions: which region of each parameter's states a rank loads, and a region copied
out of the regions a checkpoint holds (``docs/checkpoint-format.md``, "Regions").

A checkpoint of FSDP2 states holds, per state, the region each rank saved (its shard). A load
asks for one region per parameter (:func:`plan_regions`): the whole tensor in a single
process, the rank's shard under a group (FSDP2's ``Shard(d)`` at the load's rank and world
size, or the region the attached optimizer holds). A saved row that is exactly that region is
loaded as any row is (:func:`split_rows`); any other region is assembled from the rows that
overlap it (:func:`load_assembled`): each of those rows is read once, in order, through its
checksum, and the bytes that fall in the region are copied into the store's state as it is
written front to back, so RAM stays within the store's pipeline budget plus one read buffer.

Blockwise states (int8 moments, with their ``*_scale``: one scale per 256 elements of a
rank's shard) cannot be cut elsewhere than where they were saved. Loaded into the regions they
were saved with, they are taken as saved (bit for bit); into any other region (another world
size or mesh, one process) they are re-quantized (:func:`_requantize`): the saved blocks that
overlap the region are decoded to fp32 one saved region at a time, the region assembled in
fp32 and encoded anew in blocks of the region (round to nearest), as
``set_optimizer_state_dict`` does through DCP. RAM: the region in fp32 plus one saved region
(codes and fp32) at a time.
"""
from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Sequence, Tuple

import xxhash

from .._regions import Region, chunk_region, runs
from ..kernels._quant import BLOCK, INT8_ENCODING
from .._types import StateKey, StateSpec
from ..errors import CheckpointCorruptError, CheckpointMismatchError
from .filesystem import join
from .format import Manifest, ManifestRow
from .reader import READ_PIECE, ShardReader
from .stream import write_state

def nblocks(n: int) -> int:
    """Blocks of int8 moments (one scale each) of ``n`` elements."""
    return -(-n // BLOCK)


__all__ = ["Assembly", "plan_regions", "split_rows", "load_assembled", "blockwise_states"]

#: one state assembled from saved regions: (state key, region wanted, dtype row, source rows)
Assembly = Tuple[StateKey, Region, ManifestRow, List[ManifestRow]]


def blockwise_states(metadata: dict) -> Dict[str, str]:
    """``{moment state: its scale state}`` of a checkpoint whose moments are blockwise
    (int8, ``moment_encoding.scales`` of the optimizer metadata); empty otherwise."""
    enc = metadata.get("moment_encoding") if isinstance(metadata, dict) else None
    scales = enc.get("scales") if isinstance(enc, dict) else None
    if not isinstance(scales, dict):
        return {}
    return {str(k): str(v) for k, v in scales.items() if isinstance(v, str)}


def _saved_dim(rows: Sequence[ManifestRow]) -> Optional[int]:
    """The dimension the rows of one parameter's (first elementwise) state were cut along;
    the lowest one where they were cut along several (a 2-D mesh's: FSDP's dimension, which
    a load at another mesh most likely cuts too)."""
    dims = set()
    for r in rows:
        if r.spec.numel and len(r.global_shape) == len(r.shape):
            dims.update(d for d, (g, s) in enumerate(zip(r.global_shape, r.shape)) if s != g)
    return min(dims) if dims else None


def plan_regions(m: Manifest, rank: int, world: int,
                 known: Dict[str, Region]) -> Optional[Dict[str, Region]]:
    """The region of each parameter's states this rank loads, or None when the checkpoint
    holds no regions and no region is known (the ZeRO partition of whole parameters applies).

    Args:
        m: the checkpoint's manifest.
        rank, world: this process in the load's group (0, 1 without one).
        known: regions the store's attached optimizer holds (torch's order: the optimizer
            exists before the load); they are what its parameters need.
    """
    by_param: Dict[str, List[ManifestRow]] = {}
    scales = set(blockwise_states(m.metadata).values())
    for r in m.rows:
        if r.state not in scales:
            by_param.setdefault(r.param, []).append(r)
    cut = {p: _saved_dim(rs) for p, rs in by_param.items()}
    if not known and all(d is None for d in cut.values()):
        return None
    out: Dict[str, Region] = {}
    for p, rs in by_param.items():
        # the parameter's shape: its cut states' (a state kept whole, NAdam's mu_product or
        # Adafactor's row variances, has another), else the first state's
        glob = next((r.global_shape for r in rs if r.global_shape != r.shape),
                    rs[0].global_shape)
        if p in known:
            out[p] = known[p]
        elif world > 1 and cut[p] is not None:
            out[p] = chunk_region(glob, cut[p], rank, world)
        else:
            out[p] = Region.whole(glob)
    return out


def split_rows(m: Manifest, targets: Dict[str, Region]
               ) -> Tuple[List[ManifestRow], List[Assembly], Dict[str, Region]]:
    """How to load ``targets`` (a region per parameter): the rows loaded as saved (each is
    exactly its region), the states assembled from several rows, and the regions (not whole)
    the store will hold. Parameters whose saved global shape differs from the target's are
    loaded as saved (the optimizer's resume check then reports them).

    Raises:
        CheckpointMismatchError: a blockwise (int8) state asked in another region than the
            ones it was saved in.
    """
    blockwise = blockwise_states(m.metadata)
    scale_of = {s: mom for mom, s in blockwise.items()}
    by_key: Dict[StateKey, List[ManifestRow]] = {}
    for r in m.rows:
        if r.param in targets:
            by_key.setdefault(r.state_key, []).append(r)
    direct: List[ManifestRow] = []
    assembled: List[Assembly] = []
    regions: Dict[str, Region] = {}
    for k, rs in by_key.items():
        want = targets[k.param]
        if k.state in scale_of:
            continue                        # with its moment, below
        if rs[0].global_shape != want.global_shape:
            direct += rs if len(rs) == 1 else []
            continue
        if not want.is_whole:
            regions[k.param] = want
        exact = [r for r in rs if r.region == want]
        skey = StateKey(k.param, blockwise.get(k.state, ""))
        if exact:
            direct.append(exact[0])
        elif k.state in blockwise and want.numel == 0:     # an empty shard: empty states
            assembled.append((k, want, rs[0], []))
            if by_key.get(skey):
                assembled.append((skey, Region.whole((0,)), by_key[skey][0], []))
            continue
        elif k.state in blockwise:
            if _requant_problem(m, k) is not None:
                raise CheckpointMismatchError(_blockwise_message(k, rs, want)
                                              + f" ({_requant_problem(m, k)})")
            srows = by_key.get(skey, [])
            if len(srows) != len(rs):
                raise CheckpointCorruptError(f"{m.root}: tensor {str(skey)!r}: {len(srows)} "
                                             f"regions for the {len(rs)} of {str(k)!r}")
            # re-quantized in blocks of ``want`` (load_assembled): the moment, then its scales
            assembled.append((k, want, rs[0], list(rs) + list(srows)))
            assembled.append((skey, Region.whole((nblocks(want.numel),)), srows[0], []))
            continue
        else:
            assembled.append((k, want, rs[0], rs))
        if k.state in blockwise:           # its scales: the row saved with this region
            srows = sorted(by_key.get(skey, []), key=lambda r: r.offsets)
            mrows = sorted(rs, key=lambda r: r.offsets)
            i = mrows.index(exact[0])
            if len(srows) != len(mrows):
                raise CheckpointCorruptError(f"{m.root}: tensor {str(skey)!r}: {len(srows)} "
                                             f"regions for the {len(mrows)} of {str(k)!r}")
            direct.append(srows[i])
    return direct, assembled, regions


def _requant_problem(m: Manifest, k: StateKey) -> Optional[str]:
    """Why int8 state ``k`` of checkpoint ``m`` cannot be re-quantized into another region
    (None: it can): another encoding version than this release's, or not an Adam moment."""
    enc = m.metadata.get("moment_encoding") if isinstance(m.metadata, dict) else None
    version = enc.get("version", 1) if isinstance(enc, dict) else None
    if m.metadata.get("moment_dtype") != "int8" or version != INT8_ENCODING["version"]:
        return f"int8 encoding version {version!r}, this release re-quantizes version " \
               f"{INT8_ENCODING['version']}"
    if k.state not in _WHICH:
        return f"state {k.state!r} is not an Adam moment"
    return None


#: which moment each int8 state is (statestore.kernels._quant's ``which``)
_WHICH = {"exp_avg": 0, "exp_avg_sq": 1}


def _blockwise_message(k: StateKey, rows: Sequence[ManifestRow], want: Region) -> str:
    saved = ", ".join(r.region.describe() for r in rows[:4]) + (" ..." if len(rows) > 4 else "")
    return (f"state {str(k)!r} is int8-quantized in blocks of each saved shard ({saved}); "
            f"it cannot be cut into {want.describe()}. Load it at the world size it was saved "
            f"at, or move the states through torch.distributed.checkpoint "
            f"(get_optimizer_state_dict / set_optimizer_state_dict decode and re-encode them)")


def load_assembled(store, m: Manifest, items: Sequence[Assembly], pool, bar) -> None:
    """Write each state of ``items`` (already created in ``store``) from the saved rows that
    overlap its region, verifying each row's checksum over all of its bytes."""
    readers: Dict[str, ShardReader] = {}
    blockwise = blockwise_states(m.metadata)
    scale_keys = {StateKey(key.param, blockwise[key.state]) for key, _, _, rows in items
                  if key.state in blockwise and rows}
    try:
        for key, want, first, rows in items:
            if key in scale_keys:
                continue                    # written with its moment
            if key.state in blockwise and rows:
                _requantize(store, m, key, want, rows, readers, pool, bar)
            else:
                _assemble(store, m, key, want, first, rows, readers, pool, bar)
    finally:
        for f in readers.values():
            f.close()


def _pieces(src: Region, want: Region, item: int, i: int):
    for s, d, n in runs(src, want):
        yield d * item, s * item, n * item, i


def _assemble(store, m: Manifest, key: StateKey, want: Region, first: ManifestRow,
              rows: Sequence[ManifestRow], readers: Dict[str, ShardReader], pool, bar) -> None:
    spec = StateSpec(want.shape, first.spec.dtype)
    item = spec.itemsize
    sources = [r for r in rows if r.spec.numel and r.region.intersect(want) is not None]
    hashes = {id(r): xxhash.xxh3_64() for r in sources}
    done = {id(r): 0 for r in sources}            # bytes of each row read (and hashed)
    scratch = bytearray(min(READ_PIECE, max((r.nbytes for r in sources), default=0)))

    def reader(r: ManifestRow) -> ShardReader:
        if r.file not in readers:
            readers[r.file] = ShardReader(m.fs, join(m.root, r.file), pool)
        return readers[r.file]

    def skip_to(r: ManifestRow, stop: int) -> None:
        """Read (and hash) row ``r``'s bytes up to ``stop`` that the region does not take."""
        while done[id(r)] < stop:
            n = min(len(scratch), stop - done[id(r)])
            reader(r).read(memoryview(scratch)[:n], r.offset + done[id(r)], r.key,
                           hashes[id(r)].update)
            done[id(r)] += n

    # every piece of the region, in its order: (dst byte, src byte, bytes, row)
    pieces = heapq.merge(*(_pieces(r.region, want, item, i) for i, r in enumerate(sources)))
    cur: List = []
    pos = 0

    def fill(view: memoryview) -> None:
        nonlocal cur, pos
        off = 0
        while off < len(view):
            if not cur or cur[2] == 0:
                nxt = next(pieces, None)
                if nxt is None or nxt[0] != pos + off:
                    raise CheckpointCorruptError(f"{m.root}: tensor {str(key)!r}: the saved "
                                                 f"regions do not cover {want.describe()}")
                cur = list(nxt)
            r = sources[cur[3]]
            take = min(cur[2], len(view) - off)
            skip_to(r, cur[1])
            reader(r).read(view[off:off + take], r.offset + cur[1], r.key, hashes[id(r)].update)
            done[id(r)] = cur[1] + take
            cur[0] += take
            cur[1] += take
            cur[2] -= take
            off += take
        pos += len(view)
        bar.update(len(view))

    write_state(store, key, spec, fill)
    if pos != spec.nbytes:
        raise CheckpointCorruptError(f"{m.root}: tensor {str(key)!r}: the saved regions do not "
                                     f"cover {want.describe()}")
    for r in sources:
        skip_to(r, r.nbytes)
        if hashes[id(r)].hexdigest() != r.checksum:
            raise CheckpointCorruptError(f"{join(m.root, r.file)}: checksum mismatch in tensor "
                                         f"{r.key!r} (the file was altered or damaged)")



def _read_row(m: Manifest, r: ManifestRow, readers: Dict[str, ShardReader], pool) -> bytearray:
    """All of row ``r``'s bytes, its checksum verified."""
    if r.file not in readers:
        readers[r.file] = ShardReader(m.fs, join(m.root, r.file), pool)
    buf = bytearray(r.nbytes)
    h = xxhash.xxh3_64()
    view = memoryview(buf)
    for off in range(0, r.nbytes, READ_PIECE):
        piece = view[off:off + READ_PIECE]
        readers[r.file].read(piece, r.offset + off, r.key, h.update)
    if h.hexdigest() != r.checksum:
        raise CheckpointCorruptError(f"{join(m.root, r.file)}: checksum mismatch in tensor "
                                     f"{r.key!r} (the file was altered or damaged)")
    return buf


def _requantize(store, m: Manifest, key: StateKey, want: Region, rows: Sequence[ManifestRow],
                readers: Dict[str, ShardReader], pool, bar) -> None:
    """Write int8 moment ``key`` and its scales (both created in ``store``) for region
    ``want``: the saved regions of ``rows`` (the moment's rows, then its scale rows, in the
    order of their regions) that overlap ``want`` decoded, the region encoded anew."""
    import torch
    from ..kernels._quant import decode, encode
    which = _WHICH[key.state]
    half = len(rows) // 2
    mrows = sorted(rows[:half], key=lambda r: r.offsets)
    srows = sorted(rows[half:], key=lambda r: r.offsets)
    code_dtype = mrows[0].spec.dtype
    out = torch.zeros(want.numel, dtype=torch.float32)
    for mr, sr in zip(mrows, srows):
        if not mr.spec.numel or mr.region.intersect(want) is None:
            continue
        codes = torch.frombuffer(_read_row(m, mr, readers, pool), dtype=code_dtype)
        scales = torch.frombuffer(_read_row(m, sr, readers, pool), dtype=torch.float32)
        if scales.numel() != nblocks(mr.spec.numel):
            raise CheckpointCorruptError(f"{m.root}: tensor {sr.key!r} region "
                                         f"{sr.region.describe()}: {scales.numel()} scales for "
                                         f"the {mr.spec.numel} elements of {mr.key!r} "
                                         f"{mr.region.describe()}")
        vals = decode("int8", which, codes, scales)
        for a, b, n in runs(mr.region, want):
            out[b:b + n] = vals[a:a + n]
        bar.update(mr.nbytes + sr.nbytes)
    new_codes, new_scales = encode("int8", which, out, rounding="nearest")
    skey = StateKey(key.param, blockwise_states(m.metadata)[key.state])
    for k, t in ((key, new_codes.to(code_dtype)), (skey, new_scales.to(torch.float32))):
        raw = memoryview(t.contiguous().view(torch.uint8).numpy())
        pos = [0]

        def fill(view: memoryview, raw=raw, pos=pos) -> None:
            view[:] = raw[pos[0]:pos[0] + len(view)]
            pos[0] += len(view)
        write_state(store, k, StateSpec(tuple(want.shape) if k == key else (t.numel(),),
                                        t.dtype), fill)
