"""``repack.distinct.distinct``: np.unique's sorted distinct values, without numpy.ma on the short commands' path."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from repack.distinct import distinct
from tests.conftest import ROOT


def test_distinct_equals_np_unique():
    rng = np.random.default_rng(7)
    for values in (rng.integers(-5, 50, 1000), np.array([], np.int64), np.array([3]), np.array([2, 2, 2]),
                   np.array([b"b", b"a", b"ab", b"a", b""], dtype="S2"), rng.integers(0, 3, (4, 5))):
        got, want = distinct(values), np.unique(values)
        assert got.dtype == want.dtype and got.tolist() == want.tolist()


def test_planning_an_append_and_finding_removed_samples_leave_numpy_ma_unimported(tmp_path):
    """numpy 2 imports numpy.ma on the first plain np.unique (~80 ms on the device machine): the payloads of a
    task of several classes and the positions of named sources are found without it."""
    script = """
import sys
import numpy as np
from repack.jobs.image_plan import InputColumns, PayloadWriter
from repack.lifecycle.input_columns import InputColumns as Record
from repack.lifecycle.locate import wanted_positions
from repack.sources.columns import InputTable
rels = ["a/1.jpg", "b/2.jpg", "b/3.jpg", "c/4.jpg"]
table = InputTable.of_rels("/r", rels, [0, 1, 1, 2], ("a", "b", "c"), [5, 6, 7, 8], [1, 2, 3, 4], [9, 10, 11, 12])
inputs = PayloadWriter(InputColumns.of(table, "/r/"), {"a": 0, "b": 1, "c": 2}).inputs(0, 4, 0)
assert sorted(inputs["names"]) == ["0", "1", "2"], inputs["names"]
assert wanted_positions("keys", ["00000003_x", "00000001_y", "00000003_x"], None).tolist() == [1, 3]
print("numpy.ma" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
