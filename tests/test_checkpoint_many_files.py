"""A checkpoint of more tensor files than the common default limit on open files (1024).

``ckpt inspect`` and ``export`` hold every file of a step open at once, so a checkpoint
saved by 1024 ranks could not be inspected or exported under that limit, and the error
read like disk trouble. The CLI and the trainer now raise their soft limit to the hard
one (workers inherit it), and an open refused for the limit says so and what to raise.
Scaled down here: 160 files under a soft limit of 96.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from checkpoint.stfile import FileSlot, block_crc32c, header_bytes

REPO = Path(__file__).resolve().parents[1]
FILES = 160
SOFT = 96


def many_rank_checkpoint(ckpt: Path, ranks: int) -> None:
    """Step 3 of tensor ``w`` [ranks, 16], row r written by rank r into its own file, as
    a save by ``ranks`` ranks lays it out (format version 4), the manifest sealed."""
    step = ckpt / "step-000000003"
    step.mkdir(parents=True)
    files, regions = {}, []
    for r in range(ranks):
        data = torch.full((16,), float(r)).numpy().tobytes()
        key = f"w@{r}_0"
        head = header_bytes(
            [FileSlot(key, torch.float32, (1, 16), 0, len(data))], {key: block_crc32c(data, 0)}
        )
        name = f"rank-{r:05d}.safetensors"
        (step / name).write_bytes(head + data)
        files[name] = {"bytes": len(head) + len(data),
                       "header_sha256": hashlib.sha256(head).hexdigest(), "rank": r}  # fmt: skip
        regions.append([r, r, 0, 1, 16, 1])
    raw = {
        "format": "elasticd-checkpoint", "version": 4, "step": 3, "consumed_samples": 0,
        "job": "many", "world": ranks, "created_unix": time.time(), "layout": None,
        "files": files, "optimizer": {}, "extra": {}, "commit": 1,
        "tensors": {"w": {"kind": "model", "dtype": "float32", "shape": [ranks, 16],
                          "block_bytes": 16384, "regions": regions}},
    }  # fmt: skip
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    raw["checksum"] = hashlib.sha256(canon).hexdigest()
    (step / "manifest.json").write_text(json.dumps(raw))


def elasticd(args: list[str], hard: int | None) -> subprocess.CompletedProcess:
    """``elasticd ARGS`` under a soft limit of SOFT open files (and ``hard``, or the
    current hard limit)."""

    def limit() -> None:
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, now if hard is None else hard))

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "elasticd", *args], capture_output=True,
                          text=True, env=env, timeout=120, preexec_fn=limit)  # fmt: skip


def test_a_checkpoint_of_more_files_than_the_soft_limit_is_inspected_and_exported(tmp_path):
    ckpt = tmp_path / "ckpt"
    many_rank_checkpoint(ckpt, FILES)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert hard == resource.RLIM_INFINITY or hard > FILES + 64, "the hard limit is too low"
    p = elasticd(["ckpt", "inspect", str(ckpt)], hard=None)
    assert p.returncode == 0, p.stderr
    p = elasticd(["ckpt", "export", str(ckpt), str(tmp_path / "out")], hard=None)
    assert p.returncode == 0, p.stderr
    p = elasticd(["ckpt", "verify", str(ckpt)], hard=None)
    assert p.returncode == 0, p.stderr


def test_a_hard_limit_below_the_files_is_one_line_naming_the_limit(tmp_path):
    ckpt = tmp_path / "ckpt"
    many_rank_checkpoint(ckpt, FILES)
    p = elasticd(["ckpt", "inspect", str(ckpt)], hard=SOFT)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Too many open files" in p.stderr, p.stderr
    assert f"this process may hold {SOFT} open files, its hard limit {SOFT}" in p.stderr
    assert "ulimit -n" in p.stderr, p.stderr
