"""``inspect`` (what is in these files) and ``verify`` (is it intact and sane).

Both return plain dicts (JSON-ready) and a text rendering; ``verify`` lists *problems*
(checksum mismatch, unequal key lengths, NaN/Inf, unreadable files, incomplete shard sets)
and *notes* (e.g. no checksum recorded), and the CLI exits non-zero when there are problems.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Sequence

import h5py
import numpy as np

from hpctrain.data.errors import DataError, MissingKeyError
from hpctrain.data.h5files import (
    CHECKSUM_ATTR, NUMERIC_KINDS, chunk_rows_of, dataset_names, filter_pipeline, layout_of, open_h5, progress_bar,
    read_error, slabs, unavailable_filters,
)
from hpctrain.data.shard import SHARD_ATTRS, describe_sources, group_by_source, shard_ranges, source_of


def _attr(value: Any) -> Any:
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def inspect_file(path: str, keys: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Keys, shapes, dtypes, chunks, filters, sample count and shard info of one file."""
    entry: Dict[str, Any] = {"path": path}
    try:
        entry["size_bytes"] = os.path.getsize(path) if os.path.exists(path) else None
        with open_h5(path) as f:
            names = dataset_names(f)
            layout = layout_of(f, keys)
            keys = layout.sample_keys
            absent = [k for k in keys if not isinstance(f.get(k), h5py.Dataset)]
            if absent:
                raise MissingKeyError(f"no such dataset; datasets in the file: {', '.join(names) or '(none)'}",
                                      path=path, key=absent[0], hint="pass keys that exist (nested paths as a/b/c)")
            entry["attrs"] = {k: _attr(v) for k, v in f.attrs.items()}
            entry["datasets"] = {}
            for name in names:
                d = f[name]
                entry["datasets"][name] = {
                    "shape": list(d.shape), "dtype": str(d.dtype), "chunks": list(d.chunks) if d.chunks else None,
                    "compression": None if d.compression == "unknown" else d.compression, "compression_opts": _attr(d.compression_opts),
                    "shuffle": bool(d.shuffle), "fletcher32": bool(d.fletcher32),
                    "sha256": _attr(d.attrs.get(CHECKSUM_ATTR)), "sample_key": name in keys,
                    "role": layout.role(name), "note": layout.metadata.get(name),
                    "filters": [f"{nm} ({code})" for code, nm in filter_pipeline(d)],
                    "missing_filters": [f"filter {code} ({nm})" for code, nm in unavailable_filters(d)],
                    "virtual": bool(d.is_virtual), "storage_bytes": int(d.id.get_storage_size()),
                }
            lengths = {k: f[k].shape[0] if f[k].ndim else None for k in keys}
            entry["sample_keys"] = keys
            entry["num_samples"] = lengths[keys[0]] if keys and len(set(lengths.values())) == 1 else None
            entry["coordinates"] = layout.coordinates
            if entry["num_samples"] is None and keys:
                entry["error"] = (f"keys have different numbers of samples: {lengths}; HINT: name the per-sample "
                                  "keys with --keys (shard, verify) or data.keys (training)")
    except DataError as exc:
        entry["error"] = str(exc)
    return entry


def inspect_paths(paths: Sequence[str], keys: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    files = [inspect_file(p, keys) for p in paths]
    total = sum(f.get("num_samples") or 0 for f in files)
    return {"files": files, "num_files": len(files), "num_samples": total,
            "errors": sum(1 for f in files if "error" in f)}


def _mib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**20:.1f}"


def _filters_text(d: Dict[str, Any]) -> str:
    """h5py's names for its own filters (with options), HDF5's for plugin ones."""
    if d["compression"] and d["compression"] != "unknown":
        filt = [d["compression"] + (f"({d['compression_opts']})" if d["compression_opts"] is not None else "")]
        filt += ["shuffle"] * d["shuffle"] + ["fletcher32"] * d["fletcher32"]
        return ",".join(filt)
    return ",".join(x.split(" (")[0] for x in d.get("filters", []))


def render_inspect(report: Dict[str, Any]) -> str:
    lines: List[str] = []
    for f in report["files"]:
        lines.append(f"{f['path']}  ({_mib(f.get('size_bytes'))} MiB on disk)")
        if "error" in f and "datasets" not in f:
            lines.append(f"  ERROR: {f['error']}")
            continue
        lines.append(f"  samples: {f.get('num_samples')}   sample keys: {', '.join(f.get('sample_keys', []))}")
        a = f.get("attrs", {})
        if "shard_index" in a:
            lines.append(f"  shard {a['shard_index']} of {a.get('num_shards')}: rows {a.get('shard_start')}"
                         f"..{a.get('shard_stop')} of {a.get('parent_num_samples')}")
        width = max([16] + [len(n) for n in f.get("datasets", {})])
        lines.append(f"  {'key':<{width}} {'role':<10} {'shape':<18} {'dtype':<9} {'chunks':<16} {'filters':<22} "
                     f"{'MiB':>8}")
        for name, d in f.get("datasets", {}).items():
            lines.append(f"  {name:<{width}} {d['role']:<10} {str(tuple(d['shape'])):<18} {d['dtype']:<9} "
                         f"{str(tuple(d['chunks'])) if d['chunks'] else ('virtual' if d['virtual'] else 'contiguous'):<16} "
                         f"{_filters_text(d) or 'none':<22} {_mib(d['storage_bytes']):>8}")
        for name, d in f.get("datasets", {}).items():
            if d["missing_filters"]:
                lines.append(f"  WARNING: {name}: {', '.join(d['missing_filters'])} not available: "
                             "HINT: pip install hdf5plugin (or set HDF5_PLUGIN_PATH to the plugin's directory)")
        if "error" in f:
            lines.append(f"  ERROR: {f['error']}")
    if len(report["files"]) > 1:
        lines.append("")
        lines.append(f"{'file':<48} {'samples':>10} {'shard':>9} {'MiB':>9}")
        for f in report["files"]:
            a = f.get("attrs", {})
            sh = f"{a['shard_index']}/{a.get('num_shards')}" if "shard_index" in a else "-"
            name = os.path.basename(f["path"])
            lines.append(f"{name:<48} {str(f.get('num_samples')):>10} {sh:>9} {_mib(f.get('size_bytes')):>9}")
        lines.append(f"{'total':<48} {report['num_samples']:>10} {'':>9} "
                     f"{_mib(sum(f.get('size_bytes') or 0 for f in report['files'])):>9}")
    return "\n".join(lines)


def verify_file(path: str, keys: Optional[Sequence[str]] = None, bar=None) -> Dict[str, Any]:
    """Recompute checksums, count NaN/Inf, check lengths; return problems and notes."""
    problems: List[str] = []
    notes: List[str] = []
    per_key: Dict[str, Any] = {}
    entry = {"path": path, "problems": problems, "notes": notes, "keys": per_key}
    try:
        with open_h5(path) as f:
            names = dataset_names(f)
            wanted = list(keys) if keys else layout_of(f).sample_keys
            if not names:
                problems.append("file holds no datasets")
            lengths = {}
            for k in wanted:
                if not isinstance(f.get(k), h5py.Dataset):  # soft links are keys too
                    problems.append(f"key {k!r}: missing (datasets: {', '.join(names) or 'none'})")
                    continue
                d = f[k]
                lengths[k] = d.shape[0] if d.ndim else None
                per_key[k] = _verify_dataset(d, path, k, problems, notes, bar)
            if len(set(lengths.values())) > 1:
                problems.append(f"keys have different numbers of samples: {lengths}")
            elif lengths and next(iter(lengths.values())) == 0:
                problems.append("zero samples")
            recorded = f.attrs.get("num_samples")
            if recorded is not None and lengths and len(set(lengths.values())) == 1 \
                    and int(recorded) != next(iter(lengths.values())):
                problems.append(f"attribute num_samples={int(recorded)} but the keys hold {next(iter(lengths.values()))}")
            entry["shard"] = _shard_entry(f.attrs, lengths, problems, notes)
    except DataError as exc:
        problems.append(str(exc))
    return entry


def _shard_entry(attrs, lengths: Dict[str, Any], problems: List[str], notes: List[str]) -> Optional[Dict[str, Any]]:
    """A shard's recorded place in its parent (None for other files), its row range checked
    against the balanced split of the parent it names."""
    source = source_of(attrs)
    if source is None:
        return None
    entry = {a: _attr(attrs[a]) for a in SHARD_ATTRS if a in attrs}
    entry["source"], entry["source_label"], recorded = source[0], source[1], source[2]
    if not recorded:
        notes.append("source not recorded (no parent_fingerprint attribute): shards of different parents "
                     "are told apart only by the parent's sample count and checksums")
    if "stratified_by" in entry:
        notes.append(f"stratified by {entry['stratified_by']!r}: rows picked by class, not one range of the parent")
        return entry
    try:
        i, total, n = int(entry["shard_index"]), int(entry["num_shards"]), int(entry["parent_num_samples"])
        start, stop = int(entry["shard_start"]), int(entry["shard_stop"])
    except (KeyError, TypeError, ValueError):
        notes.append("row range not recorded: not checked")
        return entry
    expected = shard_ranges(n, total)[i] if 0 <= i < total and n >= total else None
    if expected != (start, stop):
        problems.append(f"shard {i} of {total} records rows {start}..{stop} of {n}; the split of {n} samples "
                        f"gives {'no such shard' if expected is None else f'rows {expected[0]}..{expected[1]}'}")
    held = set(lengths.values())
    if len(held) == 1 and held != {stop - start}:
        problems.append(f"shard holds {held.pop()} samples, its recorded rows {start}..{stop} are {stop - start}")
    return entry


def _verify_dataset(d: h5py.Dataset, path: str, key: str, problems: List[str], notes: List[str], bar) -> Dict[str, Any]:
    info: Dict[str, Any] = {"shape": list(d.shape), "dtype": str(d.dtype)}
    if d.dtype.kind not in NUMERIC_KINDS:
        problems.append(f"key {key!r}: dtype {d.dtype} is not numeric")
        return info
    if d.ndim == 0:
        problems.append(f"key {key!r}: is a scalar, expected samples along axis 0")
        return info
    h = hashlib.sha256()
    floating = d.dtype.kind in "fc"
    nan = inf = 0
    first_bad: Optional[int] = None
    row = int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize
    try:
        for lo, hi in slabs(d.shape[0], row, align=chunk_rows_of(d)):
            buf = np.empty((hi - lo,) + d.shape[1:], d.dtype)
            d.read_direct(buf, np.s_[lo:hi])
            h.update(memoryview(buf).cast("B"))
            if floating:
                isnan, isinf = np.isnan(buf), np.isinf(buf)
                n1, n2 = int(isnan.sum()), int(isinf.sum())
                if (n1 or n2) and first_bad is None:
                    bad = (isnan | isinf).reshape(hi - lo, -1).any(axis=1)
                    first_bad = lo + int(np.argmax(bad))
                nan, inf = nan + n1, inf + n2
            if bar is not None:
                bar.update(buf.nbytes)
    except Exception as exc:  # noqa: BLE001 - a damaged chunk is a finding, not a crash
        problems.append(str(read_error(exc, path, key, d)).replace("\n", " "))
        info["readable"] = False
        return info
    digest = h.hexdigest()
    info.update(sha256=digest, nan=nan, inf=inf)
    stored = _attr(d.attrs.get(CHECKSUM_ATTR))
    if stored is None:
        notes.append(f"key {key!r}: no checksum recorded (sha256 {digest[:16]}...)")
        info["checksum"] = "none"
    elif stored != digest:
        problems.append(f"key {key!r}: checksum mismatch: recorded {stored[:16]}..., data has {digest[:16]}...")
        info["checksum"] = "mismatch"
    else:
        info["checksum"] = "ok"
    if nan or inf:
        problems.append(f"key {key!r}: {nan} NaN and {inf} Inf values (first in sample {first_bad})")
    return info


def verify_paths(paths: Sequence[str], keys: Optional[Sequence[str]] = None, quiet: bool = False) -> Dict[str, Any]:
    total = 0
    for p in paths:
        try:
            total += os.path.getsize(p)
        except OSError:
            pass
    with progress_bar(total, "verify", quiet) as bar:
        files = [verify_file(p, keys, bar) for p in paths]
    report: Dict[str, Any] = {"files": files, "problems": []}
    shards = [f["shard"] for f in files if f.get("shard")]
    groups = group_by_source([(f["path"], (f["shard"]["source"], f["shard"]["source_label"], True))
                              for f in files if f.get("shard")])
    if len(groups) > 1:
        report["problems"].append(f"shards from {len(groups)} different parent files in one set: "
                                  f"{describe_sources(groups, limit=len(files))}")
    elif shards and len(shards) == len(files) and len(files) > 1:
        totals = {s["num_shards"] for s in shards}
        idx = sorted(s["shard_index"] for s in shards)
        if len(totals) == 1 and idx != list(range(next(iter(totals)))):
            missing = sorted(set(range(next(iter(totals)))) - set(idx))
            report["problems"].append(f"shard set incomplete: {len(idx)} of {next(iter(totals))} shards given, "
                                      f"missing {missing}")
    report["ok"] = not report["problems"] and not any(f["problems"] for f in files)
    return report


def render_verify(report: Dict[str, Any]) -> str:
    lines: List[str] = []
    for f in report["files"]:
        status = "OK" if not f["problems"] else "PROBLEMS"
        lines.append(f"{f['path']}: {status}")
        if f.get("shard"):
            sh = f["shard"]
            lines.append(f"  shard {sh.get('shard_index')} of {sh.get('num_shards')} of {sh['source_label']}")
        for k, info in f["keys"].items():
            if "sha256" in info:
                lines.append(f"  {k:<16} checksum {info['checksum']:<8} NaN {info['nan']:<6} Inf {info['inf']}")
        lines += [f"  problem: {p}" for p in f["problems"]]
        lines += [f"  note: {n}" for n in f["notes"]]
    lines += [f"problem: {p}" for p in report["problems"]]
    lines.append("all files OK" if report["ok"] else "verification FAILED")
    return "\n".join(lines)
