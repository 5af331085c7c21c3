"""Regenerate docs/report.png, the README's picture of `repack inspect OUT --html`:
`python -m tests.tools.report_screenshot [docs/report.png]` (needs chromium)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

from tests.tools.browser import render
from tests.tools.photos import make_photo_tree


def main(target: str = "docs/report.png") -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = make_photo_tree(root / "photos", per_class=40, classes=6, seed=0, min_side=96, max_side=900)
        good = files[0].read_bytes()
        (files[0].parent / "truncated.jpg").write_bytes(good[: len(good) // 3])
        (files[0].parent / "empty.jpg").write_bytes(b"")
        shutil.copy(files[3], files[-1].parent / "copy.jpg")
        repack = [sys.executable, "-m", "repack"]
        subprocess.run(repack + ["images", str(root / "photos"), str(root / "out"), "--shard-size", "64", "--quiet"],
                       check=True)
        subprocess.run(repack + ["inspect", str(root / "out"), "--html", str(root / "report.html")], check=True,
                       stdout=subprocess.DEVNULL)
        shot = root / "shot.png"
        render(root / "report.html", shot, width=1040, height=1900)
        image = Image.open(shot).convert("RGB")
        image = image.resize((image.width * 3 // 4, image.height * 3 // 4), Image.LANCZOS)
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        image.quantize(colors=128).save(target, optimize=True)
    print(f"{target}: {Path(target).stat().st_size} bytes")


if __name__ == "__main__":
    main(*sys.argv[1:])
