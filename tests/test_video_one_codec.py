"""`repack video SRC OUT --probe --transcode` as users type it, and the legacy reader's one-codec rule:
an all-HEVC dataset stays HEVC (only what fails another check is transcoded, to HEVC), a mixed one
becomes H.264. Real ffmpeg/ffprobe clips; an independent ffprobe checks every output's codec."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from repack.transforms.nvdec_rules import dataset_codec
from tests.conftest import read_manifest_json, run_repack
from tests.tools.videos import SRC, _ffmpeg, encoders, video_codecs

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None or "libx265" not in encoders(),
                                reason="needs ffmpeg with libx265")

X265 = ("-c:v", "libx265", "-preset", "ultrafast", "-pix_fmt", "yuv420p", "-tag:v", "hvc1")
X264 = ("-c:v", "libx264", "-preset", "ultrafast", "-g", "25", "-bf", "0", "-pix_fmt", "yuv420p")


def _clip(path: Path, args: tuple[str, ...], seconds: float = 1.0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _ffmpeg(["-f", "lavfi", "-i", SRC.format(w=192, h=144, r=25, d=seconds), *args, str(path)])


@pytest.fixture(scope="module")
def hevc_tree(tmp_path_factory) -> Path:
    """Two HEVC clips NVDEC takes as is, one HEVC clip with a 2 s keyframe gap (needs a transcode)."""
    root = tmp_path_factory.mktemp("hevc")
    keyint = "-x265-params", "log-level=none:keyint=25"
    _clip(root / "a/one.mp4", X265 + keyint)
    _clip(root / "a/two.mp4", X265 + keyint)
    _clip(root / "b/long_gop.mp4", X265 + ("-x265-params", "log-level=none:keyint=50:min-keyint=50:scenecut=0"),
          seconds=2.0)
    return root


def _probes(out: Path) -> dict:
    return {p["source"]: p for p in map(json.loads, (out / "probe.jsonl").read_text().splitlines())}


def test_rule_keeps_one_encodable_codec():
    assert dataset_codec(["hevc", "hevc", None]) == "hevc"
    assert dataset_codec(["hevc", "h264"]) == "h264"            # mixed: H.264
    assert dataset_codec(["vp9", "vp9"]) == "h264"              # one codec repack cannot encode to
    assert dataset_codec(["hevc"], encoders=("h264",)) == "h264"  # no libx265
    assert dataset_codec(["hevc"], reader="experimental") == "h264"


def test_probe_transcode_keeps_an_all_hevc_dataset_hevc(hevc_tree, tmp_path):
    out = tmp_path / "out"
    proc = run_repack("video", hevc_tree, out, "--probe", "--transcode", "--preset", "ultrafast", "--quiet")
    assert "deprecated" not in proc.stderr and "contradict" not in proc.stderr
    manifest = read_manifest_json(out)
    assert manifest["codec"] == "hevc" and manifest["mode"] == "transcode"
    probes = _probes(out)
    assert probes["a/one.mp4"]["decision"] == "ok" and probes["a/two.mp4"]["decision"] == "ok"
    assert [r["code"] for r in probes["b/long_gop.mp4"]["reasons"]] == ["long_gop"]
    assert manifest["totals"]["videos"] == 3 and manifest["totals"]["transcoded"] == 1
    for entry in manifest["shards"]:  # one codec, HEVC, in every output (the transcode too)
        assert video_codecs(out / entry["path"]) == ["hevc"], entry
    # the HEVC transcode is reproducible: a second run writes the same bytes
    again = tmp_path / "again"
    run_repack("video", hevc_tree, again, "--probe", "--transcode", "--preset", "ultrafast", "--quiet")
    assert [s["sha256"] for s in read_manifest_json(again)["shards"]] == [s["sha256"] for s in manifest["shards"]]


def test_mixed_codecs_become_h264(hevc_tree, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hevc_tree / "a", src / "a")
    _clip(src / "a/h264.mp4", X264 + ("-movflags", "+faststart"))
    out = tmp_path / "out"
    run_repack("video", src, out, "--probe", "--transcode", "--preset", "ultrafast", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["codec"] == "h264"
    assert manifest["stats"]["reasons"] == {"legacy_one_codec": 2}
    assert {c for e in manifest["shards"] for c in video_codecs(out / e["path"])} == {"h264"}


def test_a_picture_among_hevc_videos_leaves_the_dataset_hevc(hevc_tree, tmp_path):
    """A JPEG named .mp4 (and a GIF) is no video: quarantined as a still, it chose H.264 for the whole dataset,
    so every HEVC video was re-encoded."""
    from tests.benchmarks.tiny_files import jpeg_bytes

    src = tmp_path / "src"
    shutil.copytree(hevc_tree / "a", src / "a")
    (src / "a/photo.mp4").write_bytes(jpeg_bytes(3))
    out = tmp_path / "out"
    run_repack("video", src, out, "--probe", "--transcode", "--preset", "ultrafast", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["codec"] == "hevc" and manifest["totals"]["transcoded"] == 0
    assert [q["source"] for q in manifest["quarantine"]] == ["a/photo.mp4"]


def test_probe_alone_is_probe_only(hevc_tree, tmp_path):
    out = tmp_path / "out"
    proc = run_repack("video", hevc_tree, out, "--probe", "--json", "--quiet")
    assert "deprecated" not in proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["decisions"] == {"ok": 2, "transcode": 1, "reject": 0}
    assert not (out / "videos").exists() and read_manifest_json(out)["mode"] == "probe"
    assert "--probe" in run_repack("video", "--help").stdout
