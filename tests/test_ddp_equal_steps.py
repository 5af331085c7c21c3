"""Equal steps on every rank (issue 27, item 4), with real torch.distributed (gloo) in 2 and 3
processes: every reader yields as many batches on every rank, for 0 and 2 workers and both drop_last
settings, on a dataset of 103 samples in uneven shards (25, 25, 25, 25, 3): ImageShardDataset (samples
and batch mode), LmdbImageDataset with ResumableSampler, and Mixture(exhausted="stop") without samples=."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_repack
from tests.test_images_job import write_jpegs


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    base = tmp_path_factory.mktemp("uneven")
    for c, count in enumerate((40, 35, 28)):
        write_jpegs(base / "src" / f"c{c}", count, f"c{c}_")
    run_repack("images", base / "src", base / "images", "--shard-size", "25", "--quiet")
    run_repack("images", base / "src", base / "lmdb", "--to", "lmdb", "--quiet")
    return {"images": str(base / "images"), "lmdb": str(base / "lmdb")}


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_yields_as_many_batches(uneven, tmp_path, world):
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, "-m", "tests.tools.ddp_steps", str(rank), str(world), str(init),
                               json.dumps(uneven)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    per_rank = json.loads(outs[0][0].strip().splitlines()[-1])
    assert len(per_rank) == world
    for name in per_rank[0]:
        counts = [counts[name] for counts in per_rank]
        assert len(set(counts)) == 1 and counts[0] > 0, f"{name}: batches per rank {counts}"
