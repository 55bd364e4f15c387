"""Whole-checkpoint checks (``elasticd ckpt verify``) and consolidated export."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from safetensors.torch import save_file

from checkpoint.errors import CheckpointError, CorruptCheckpointError
from checkpoint.load import Checkpoint
from checkpoint.manifest import st_code
from checkpoint.planner import coverage_problem
from checkpoint.stfile import file_sha256, read_header


def verify(ckpt: Checkpoint) -> list[str]:
    """Every problem found: file checksums and sizes, headers, and shard coverage."""
    problems: list[str] = []
    headers: dict[str, dict] = {}
    for name, meta in sorted(ckpt.manifest.files.items()):
        path = os.path.join(ckpt.path, name)
        try:
            # Refused unless a regular file of the manifest's size, before anything is read.
            sha, _ = file_sha256(path, expect_bytes=meta.bytes)
            _, headers[name] = read_header(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if sha != meta.sha256:
            problems.append(f"{path}: sha256 mismatch (corrupted)")
    for tname, entry in sorted(ckpt.manifest.tensors.items()):
        problem = coverage_problem(tname, entry.shape, [(c.offsets, c.sizes) for c in entry.chunks])
        if problem:
            problems.append(problem)
        for c in entry.chunks:
            head = headers.get(c.file)
            if head is None:
                if c.file not in ckpt.manifest.files:
                    problems.append(f"{tname}: shard in unlisted file {c.file}")
                continue
            info = head.get(c.key)
            want = {"dtype": st_code(entry.dtype), "shape": list(c.sizes)}
            if info is None or {k: info.get(k) for k in want} != want:
                problems.append(
                    f"{tname}: {c.file} key {c.key} is missing or has the wrong dtype/shape"
                )
    return problems


def export(
    ckpt: Checkpoint,
    out: str,
    *,
    max_file_bytes: int = 5 << 30,
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """Write the model tensors, consolidated, as Hugging-Face-style safetensors.

    One ``model.safetensors`` when the total fits ``max_file_bytes``; otherwise
    ``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``.
    Returns the files written.
    """
    names = sorted(n for n, e in ckpt.manifest.tensors.items() if e.kind == "model")
    if not names:
        raise CorruptCheckpointError(f"{ckpt.path}: holds no model tensors to export")
    ckpt.check_files()  # refuse a bad file before writing anything
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = ckpt.manifest.tensors[n].nbytes
        if groups[-1] and size + nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    os.makedirs(out, exist_ok=True)
    meta = {"format": "pt", "step": str(ckpt.step)}
    if len(groups) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for fname, group in zip(files, groups, strict=True):
        tensors = {n: ckpt.read(n) for n in group}
        save_file(tensors, os.path.join(out, fname), metadata=meta)
        weight_map.update(dict.fromkeys(group, fname))
        if log:
            log(f"wrote {fname} ({len(group)} tensors)")
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(ckpt.manifest.tensors[n].nbytes for n in names)},
            "weight_map": weight_map,
        }
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        files.append("model.safetensors.index.json")
    return files
