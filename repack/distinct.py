"""Sorted distinct values of a 1-D array: ``np.unique(values)`` without its import of ``numpy.ma``.

numpy 2's plain ``np.unique(values)`` imports ``numpy.ma`` on its first call (to ask whether the array
is masked): ~10 ms on the development VM, ~80 ms on the device machine, on the critical path of the
short commands (`--append` plans its new inputs with it, `repack remove` finds its samples with it).
``np.unique`` with ``return_index``, ``return_inverse`` or ``return_counts`` does not import it.
"""

from __future__ import annotations

import numpy as np


def distinct(values) -> np.ndarray:
    """The sorted distinct values of ``values`` (flattened), as ``np.unique(values)`` returns them."""
    ordered = np.sort(np.asarray(values).ravel())
    if len(ordered) < 2:
        return ordered
    first = np.empty(len(ordered), dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return ordered[first]
