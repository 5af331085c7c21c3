"""The blocks of the docs pages in tests/test_readme.py's LONG_PAGES (docs/report.md's `repack bench`
sweeps are most of a minute), run as written the same way: a file of their own, so that with
``--dist loadfile`` another pytest-xdist worker runs them beside tests/test_readme.py."""

from __future__ import annotations

import pytest

from tests.test_readme import run_page, runs


@pytest.mark.parametrize(("page", "sandboxes"), runs(long_pages=True), ids=[f"{p}::{'+'.join(s)}" for p, s in runs(True)])
def test_long_pages_run_as_written(page, sandboxes, tmp_path):
    run_page(page, sandboxes, tmp_path)
