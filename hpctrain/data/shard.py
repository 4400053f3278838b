"""``shard`` one HDF5 file into N balanced files, and ``merge`` shards back into one.

Sample keys (the root ``keys`` attribute of packed files, else every dataset) are split
along axis 0 with :func:`shard_ranges` (sizes differ by at most one); other datasets are
copied whole into each shard. Dtypes, chunk shapes (clamped to the shard length), filters
and attributes are kept. Each shard records where it came from (``shard_index``,
``num_shards``, ``shard_start``, ``shard_stop``, the parent's file name, fingerprint,
checksums and chunks), so ``merge`` restores the parent bit for bit, checks it against the
parent's checksums, and refuses a set whose shards come from different parents.

The parent fingerprint is computed from the parent alone (sample count, keys, shapes,
dtypes, recorded checksums and the bytes of its first, middle and last rows): shards of one
parent written by separate runs (``--only``, one SLURM array task each) carry the same one.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import h5py

from hpctrain.comm.plan import chunk_bounds
import numpy as np

from hpctrain.data.errors import ChecksumError, ConfigError, DataError, LengthMismatchError, TooFewSamplesError
from hpctrain.data.h5files import (
    CHECKSUM_ATTR, atomic_output, chunk_rows_of, copyable_attrs, creation_kwargs, dataset_names, get_dataset,
    json_attr, layout_of,
    open_h5, progress_bar, read_error, slabs,
)
from hpctrain.data.strata import runs_of, stratified_split

SHARD_ATTRS = ("shard_index", "num_shards", "shard_start", "shard_stop", "parent_num_samples",
               "parent_checksums", "parent_chunks", "parent_name", "parent_fingerprint", "stratified_by")


def shard_ranges(n: int, num_shards: int) -> List[Tuple[int, int]]:
    """Balanced [start, stop) ranges: the first ``n % num_shards`` get one sample more."""
    return chunk_bounds(n, num_shards)


def sample_keys(f: h5py.File, path: str, keys: Optional[Sequence[str]] = None) -> List[str]:
    """The datasets that hold one entry per sample: given, the ``keys`` attribute, or the
    numeric datasets sharing the leading axis (dimension scales and coordinates excluded)."""
    if keys:
        return list(keys)
    found = layout_of(f).sample_keys
    if not found:
        raise DataError("file holds no per-sample datasets", path=path,
                        hint="name them with --keys (see `hpctrain data inspect FILE`)")
    return found


def other_datasets(f: h5py.File, keys: Sequence[str]) -> List[str]:
    """Datasets that are not sample keys, nor the same object as one under another name (a
    key given as a soft link, e.g. NeXus's ``entry/data/data`` -> the detector's data)."""
    key_ids = {f[k].id for k in keys if isinstance(f.get(k), h5py.Dataset)}
    return [n for n in dataset_names(f) if n not in keys and f[n].id not in key_ids]


def _lengths(f: h5py.File, path: str, keys: Sequence[str]) -> int:
    lengths = {k: get_dataset(f, k, path).shape[0] for k in keys}
    if len(set(lengths.values())) > 1:
        raise LengthMismatchError(f"keys have different numbers of samples {lengths}; expected equal",
                                  path=path, key=max(lengths, key=lengths.get),
                                  hint="pass --keys with the per-sample datasets only")
    return next(iter(lengths.values()))


def parent_fingerprint(f: h5py.File, path: str, keys: Sequence[str], n: int, sums: Mapping[str, str]) -> str:
    """A short hash that tells parents apart: layout, recorded checksums and a few rows' bytes
    (cheap for any size; the full content is covered by the per-key checksums)."""
    h = hashlib.sha256(json_attr({"num_samples": n, "checksums": dict(sums),
                                  "keys": {k: [list(f[k].shape), str(f[k].dtype)] for k in keys}}).encode())
    for k in keys:
        for i in sorted({0, n // 2, max(n - 1, 0)} if n else set()):
            try:
                h.update(np.ascontiguousarray(f[k][i]).tobytes())
            except Exception as exc:
                raise read_error(exc, path, k, f[k]) from exc
    return h.hexdigest()[:32]


def source_of(attrs: Mapping[str, Any]) -> Optional[Tuple[str, str, bool]]:
    """``(identity, label, recorded)`` of a shard's parent from its attributes; None for a file
    that is not a shard. Shards written without a fingerprint are told apart by what they do
    record (the parent's sample count and checksums); ``recorded`` is then False."""
    if "shard_index" not in attrs:
        return None
    n = attrs.get("parent_num_samples")
    n = None if n is None else int(n)
    fp = attrs.get("parent_fingerprint")
    if fp is not None:
        fp = fp.decode() if isinstance(fp, bytes) else str(fp)
        name = attrs.get("parent_name", "?")
        name = name.decode() if isinstance(name, bytes) else str(name)
        return fp, f"{name!r} (fingerprint {fp[:12]}, {n} samples)", True
    sums = attrs.get("parent_checksums", "")
    sums = sums.decode() if isinstance(sums, bytes) else str(sums)
    return f"unrecorded:{n}:{sums}", f"an unrecorded parent of {n} samples", False


def describe_sources(groups: Mapping[str, Tuple[str, List[str]]], limit: int = 3) -> str:
    """``label: file, file, ... and N more; label: ...`` for each parent of a mixed set."""
    parts = []
    for label, files in groups.values():
        names = [os.path.basename(p) for p in files]
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        parts.append(f"{label}: {', '.join(names[:limit])}{more}")
    return "; ".join(parts)


def group_by_source(sources: Sequence[Tuple[str, Optional[Tuple[str, str, bool]]]]) -> Dict[str, Tuple[str, List[str]]]:
    """The shards among ``(path, source_of(...))`` pairs, grouped by parent (first-seen order)."""
    groups: Dict[str, Tuple[str, List[str]]] = {}
    for path, src in sources:
        if src is not None:
            groups.setdefault(src[0], (src[1], []))[1].append(path)
    return groups


def _copy_rows(src: h5py.Dataset, dst: h5py.Dataset, lo: int, hi: int, path: str, bar=None, *, pos: int = 0,
               digest=None) -> str:
    """Copy rows [lo, hi) of ``src`` to ``dst[pos:pos+hi-lo]`` in chunk-aligned slabs; return
    the sha256 of the rows (fed into ``digest`` when given, to hash several runs as one)."""
    h = digest if digest is not None else hashlib.sha256()
    row = int(np.prod(src.shape[1:], dtype=np.int64)) * src.dtype.itemsize
    align = dst.chunks[0] if dst.chunks else 1
    buf = None
    for a, b in slabs(hi - lo, row, align=align):
        if buf is None or buf.shape[0] != b - a:
            buf = np.empty((b - a,) + src.shape[1:], src.dtype)
        try:
            src.read_direct(buf, np.s_[lo + a:lo + b])
        except Exception as exc:
            raise read_error(exc, path, src.name.lstrip("/"), src) from exc
        dst[pos + a:pos + b] = buf
        h.update(memoryview(buf).cast("B"))
        if bar is not None:
            bar.update(buf.nbytes)
    return h.hexdigest()


def _copy_whole(src: h5py.Dataset, dst_file: h5py.File, name: str) -> None:
    d = dst_file.create_dataset(name, data=src[()], **{k: v for k, v in creation_kwargs(src).items() if k != "dtype"})
    d.attrs.update(copyable_attrs(src))


def shard_name(src: str, index: int, num_shards: int) -> str:
    return f"{Path(src).stem}-{index:05d}-of-{num_shards:05d}.h5"


def shard(src: str, num_shards: int, out_dir: str, *, keys: Optional[Sequence[str]] = None,
          rank: int = 0, size: int = 1, quiet: bool = False, only: Optional[Sequence[int]] = None,
          stratify: Optional[str] = None) -> List[str]:
    """Split ``src`` into ``num_shards`` files in ``out_dir``; rank r of size writes shards r, r+size, ...
    ``only``: write just these shard indices (e.g. one per task of a SLURM job array), still
    divided among the ranks. ``stratify``: a 1-D per-sample key (class labels); every shard
    then holds the same class proportions (see :func:`hpctrain.data.strata.stratified_split`)
    and its rows, in parent order, are no longer one contiguous range.

    Returns the paths this rank wrote.
    """
    if num_shards < 1:
        raise ConfigError(f"--num-shards must be at least 1, got {num_shards}", hint="use --num-shards 1 or more")
    if only is not None:
        bad = [i for i in only if not 0 <= i < num_shards]
        if bad:
            raise ConfigError(f"--only {bad[0]}: shard indices run from 0 to {num_shards - 1} (--num-shards {num_shards})",
                              hint="pass indices from 0 to num_shards - 1")
    written: List[str] = []
    with open_h5(src) as f:
        keys = sample_keys(f, src, keys)
        n = _lengths(f, src, keys)
        if n < num_shards:
            raise TooFewSamplesError(f"{n} samples cannot fill {num_shards} shards (each needs one)",
                                     path=src, key=keys[0], hint=f"use --num-shards <= {n}")
        parent_sums = {k: f[k].attrs.get(CHECKSUM_ATTR) for k in keys}
        parent_sums = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in parent_sums.items() if v is not None}
        parent = {
            "parent_num_samples": n, "parent_checksums": json_attr(parent_sums), "parent_name": Path(src).name,
            "parent_chunks": json_attr({k: list(f[k].chunks) if f[k].chunks else None for k in keys}),
            "parent_fingerprint": parent_fingerprint(f, src, keys, n, parent_sums),
        }
        rows = _shard_rows(f, src, keys, n, num_shards, stratify)
        os.makedirs(out_dir, exist_ok=True)
        wanted = sorted(set(only)) if only is not None else list(range(num_shards))
        mine = wanted[rank::size]
        total = sum(_count(rows[i]) * sum(f[k].dtype.itemsize * int(np.prod(f[k].shape[1:], dtype=np.int64))
                                          for k in keys) for i in mine)
        with progress_bar(total, f"shard {Path(src).name}", quiet) as bar:
            for i in mine:
                out = os.path.join(out_dir, shard_name(src, i, num_shards))
                attrs = dict(parent, shard_index=i, num_shards=num_shards)
                if stratify:
                    attrs["stratified_by"] = stratify
                else:
                    attrs.update(shard_start=rows[i][0], shard_stop=rows[i][1])
                _write_shard(f, src, out, keys, rows[i], attrs, bar)
                written.append(out)
    return written


def _count(rows) -> int:
    return int(rows[1] - rows[0]) if isinstance(rows, tuple) else int(len(rows))


def _shard_rows(f: h5py.File, path: str, keys: Sequence[str], n: int, num_shards: int,
                stratify: Optional[str]) -> List[Any]:
    """Each shard's rows: a ``(start, stop)`` range, or (stratified) an ascending index array."""
    if not stratify:
        return shard_ranges(n, num_shards)
    if stratify not in keys:
        raise ConfigError(f"--stratify {stratify!r} is not one of the per-sample keys ({', '.join(keys)})",
                          hint="pass the label key, e.g. --stratify y (see `hpctrain data inspect FILE`)")
    labels = get_dataset(f, stratify, path)
    if labels.ndim != 1 or labels.dtype.kind not in "biu":
        raise ConfigError(f"--stratify {stratify!r}: expected one integer class label per sample, got shape "
                          f"{labels.shape} dtype {labels.dtype}", path=path, key=stratify,
                          hint="stratify by an integer label key of shape (N,)")
    try:
        values = labels[()]
    except Exception as exc:
        raise read_error(exc, path, stratify, labels) from exc
    return stratified_split(values, num_shards)


def _write_shard(f: h5py.File, src: str, out: str, keys: Sequence[str], rows, attrs: Dict[str, Any], bar) -> None:
    """One shard file: the ``rows`` of each sample key, the other datasets whole, attributes."""
    count = _count(rows)
    runs = [rows] if isinstance(rows, tuple) else runs_of(rows)
    with atomic_output(out) as tmp:
        with h5py.File(tmp, "w") as g:
            for k in keys:
                s = f[k]
                d = g.create_dataset(k, shape=(count,) + s.shape[1:], **creation_kwargs(s, count))
                d.attrs.update(copyable_attrs(s))
                h = hashlib.sha256()
                pos = 0
                for lo, hi in runs:
                    _copy_rows(s, d, lo, hi, src, bar, pos=pos, digest=h)
                    pos += hi - lo
                d.attrs[CHECKSUM_ATTR] = h.hexdigest()
            for name in other_datasets(f, keys):
                _copy_whole(f[name], g, name)
            g.attrs.update(copyable_attrs(f))
            g.attrs.update(dict(attrs, num_samples=count))
            if "keys" not in g.attrs:
                g.attrs["keys"] = json_attr(list(keys))


def _attr_json(f: h5py.File, name: str, default):
    try:
        return json.loads(f.attrs[name]) if name in f.attrs else default
    except (TypeError, ValueError):
        return default


def order_shards(paths: Sequence[str]) -> List[Tuple[str, Optional[int]]]:
    """Shards sorted by their recorded index (given order for files without one)."""
    found = []
    for p in paths:
        with open_h5(p) as f:
            idx = f.attrs.get("shard_index")
            total = f.attrs.get("num_shards")
            found.append((p, None if idx is None else int(idx), None if total is None else int(total)))
    indexed = [x for x in found if x[1] is not None]
    if indexed and len(indexed) == len(found):
        totals = {t for _, _, t in found}
        idxs = sorted(i for _, i, _ in found)
        if len(totals) != 1 or idxs != list(range(next(iter(totals)))):
            missing = sorted(set(range(max(totals))) - set(idxs))
            dup = sorted({i for i in idxs if idxs.count(i) > 1})
            raise DataError(f"shards do not form one complete set: num_shards {sorted(totals)}, "
                            f"missing {missing}, duplicated {dup}", path=paths[0],
                            hint="pass every shard of one `shard` run exactly once")
        found.sort(key=lambda x: x[1])
    return [(p, i) for p, i, _ in found]


def check_one_parent(paths: Sequence[str]) -> None:
    """Raise a DataError naming the parents when the shards among ``paths`` come from more than one."""
    sources = []
    for p in paths:
        with open_h5(p) as f:
            sources.append((p, source_of(f.attrs)))
    groups = group_by_source(sources)
    if len(groups) > 1:
        raise DataError(f"these shards come from {len(groups)} different parent files: {describe_sources(groups)}",
                        hint="merge the shards of one `hpctrain data shard` run only; "
                             "`hpctrain data verify` lists which file comes from which parent")


def merge(paths: Sequence[str], out: str, *, keys: Optional[Sequence[str]] = None, quiet: bool = False) -> str:
    """Concatenate shards (in shard order) into ``out``; check against the parent checksums."""
    if not paths:
        raise ConfigError("no shards to merge", hint="pass the shard files (or their directory)")
    check_one_parent(paths)
    _refuse_stratified(paths)
    ordered = [p for p, _ in order_shards(paths)]
    files = [open_h5(p) for p in ordered]
    try:
        first = files[0]
        keys = sample_keys(first, ordered[0], keys)
        counts = _check_alike(files, ordered, keys)
        n = sum(counts)
        parent_sums = _attr_json(first, "parent_checksums", {})
        parent_chunks = _attr_json(first, "parent_chunks", {})
        row_bytes = sum(first[k].dtype.itemsize * int(np.prod(first[k].shape[1:], dtype=np.int64)) for k in keys)
        others = other_datasets(first, keys)
        with atomic_output(out) as tmp, progress_bar(n * row_bytes, f"merge {Path(out).name}", quiet) as bar:
            with h5py.File(tmp, "w") as g:
                for k in keys:
                    kw = creation_kwargs(first[k], n)
                    if parent_chunks.get(k):
                        kw["chunks"] = tuple(parent_chunks[k])
                    d = g.create_dataset(k, shape=(n,) + first[k].shape[1:], **kw)
                    d.attrs.update(copyable_attrs(first[k]))
                    h = hashlib.sha256()
                    pos = 0
                    for f, p, c in zip(files, ordered, counts):
                        _merge_rows(f[k], d, pos, c, p, h, bar)
                        pos += c
                    digest = h.hexdigest()
                    want = parent_sums.get(k)
                    if want and want != digest:
                        raise ChecksumError(f"merged data has sha256 {digest[:16]}..., the parent had "
                                            f"{want[:16]}...; a shard is damaged or from another file",
                                            path=out, key=k, hint="run `hpctrain data verify` on the shards")
                    d.attrs[CHECKSUM_ATTR] = want or digest
                for name in others:
                    _copy_whole(first[name], g, name)
                g.attrs.update({a: v for a, v in copyable_attrs(first).items() if a not in SHARD_ATTRS})
                g.attrs["num_samples"] = n
    finally:
        for f in files:
            f.close()
    return out


def _refuse_stratified(paths: Sequence[str]) -> None:
    for p in paths:
        with open_h5(p) as f:
            by = f.attrs.get("stratified_by")
        if by is not None:
            raise DataError(f"is a stratified shard (rows picked by class of {_text(by)!r}, not one range of "
                            "the parent): concatenating such shards does not restore the parent", path=p,
                            hint="train on the shards as they are, or keep the parent; shard without "
                                 "--stratify to be able to merge")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _check_alike(files: Sequence[h5py.File], paths: Sequence[str], keys: Sequence[str]) -> List[int]:
    """The sample count of each file, once every key's sample shape and dtype agree across
    the files and (for shards) the counts add up to the parent's."""
    first = files[0]
    counts = [_lengths(f, p, keys) for f, p in zip(files, paths)]
    for f, p in zip(files[1:], paths[1:]):
        for k in keys:
            a, b = first[k], get_dataset(f, k, p)
            if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
                raise LengthMismatchError(f"sample shape {b.shape[1:]} dtype {b.dtype} differs from "
                                          f"{paths[0]}'s {a.shape[1:]} {a.dtype}", path=p, key=k,
                                          hint="pass shards of one `hpctrain data shard` run only")
    parent_n = first.attrs.get("parent_num_samples")
    if parent_n is not None and int(parent_n) != sum(counts):
        raise LengthMismatchError(f"the shards hold {sum(counts)} samples, their parent had {int(parent_n)}",
                                  path=paths[0], hint="pass every shard of one `hpctrain data shard` run "
                                                      "exactly once; `hpctrain data verify` checks a set")
    return counts


def _merge_rows(src: h5py.Dataset, dst: h5py.Dataset, pos: int, count: int, path: str, h, bar) -> None:
    # Write in slabs aligned to the destination's chunks where possible.
    row = int(np.prod(src.shape[1:], dtype=np.int64)) * src.dtype.itemsize
    for a, b in slabs(count, row, align=chunk_rows_of(dst)):
        buf = np.empty((b - a,) + src.shape[1:], src.dtype)
        try:
            src.read_direct(buf, np.s_[a:b])
        except Exception as exc:
            raise read_error(exc, path, src.name.lstrip("/"), src) from exc
        dst[pos + a:pos + b] = buf
        h.update(memoryview(buf).cast("B"))
        if bar is not None:
            bar.update(buf.nbytes)
