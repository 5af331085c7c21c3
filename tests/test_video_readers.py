"""Video readers over `repack video` outputs: the PyTorch clip dataset (PyAV, CPU) and the DALI
pipeline (experimental reader on DALI's CPU backend with VP8/VP9, codecs its PyPI FFmpeg decodes
and `--dali-reader experimental` keeps as is; the default legacy reader is GPU only). Each clip
frame N has luma 16 + 4*N, so decoded frames reveal their index."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from pipelines.torch_video import VideoClipDataset, clip_starts
from tests.conftest import run_repack
from tests.tools.videos import encoders, make_index_clip

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None or "libvpx" not in encoders(),
                                reason="ffmpeg with the libvpx (VP8) encoder is not installed")
MJPEG = ("-c:v", "mjpeg", "-pix_fmt", "yuvj420p", "-q:v", "2")
VP8 = ("-c:v", "libvpx", "-deadline", "realtime", "-g", "8", "-pix_fmt", "yuv420p")
VP9 = ("-c:v", "libvpx-vp9", "-deadline", "realtime", "-g", "8", "-pix_fmt", "yuv420p")


def frame_numbers(clip) -> list[float]:
    return [round((float(np.asarray(f, dtype=np.float64).mean()) - 16) / 4, 1) for f in clip]


@pytest.fixture(scope="session")
def index_datasets(tmp_path_factory):
    """(VP8 copied as is for the experimental reader, H.264 transcoded from 64x48 MJPEG) datasets,
    two classes each."""
    src = tmp_path_factory.mktemp("index-src")
    make_index_clip(src / "mj/a/one.webm", 30, VP8, size=(96, 64))
    make_index_clip(src / "mj/b/two.webm", 23, VP8, size=(96, 64))
    make_index_clip(src / "tc/a/one.avi", 30, MJPEG, size=(64, 48))
    make_index_clip(src / "tc/b/two.avi", 23, MJPEG, size=(64, 48))
    out = tmp_path_factory.mktemp("index-out")
    run_repack("video", src / "mj", out / "mj", "--transcode", "--dali-reader", "experimental", "--quiet")
    run_repack("video", src / "tc", out / "tc", "--transcode", "--quiet", "--crf", "10")
    return out / "mj", out / "tc"


def test_clip_starts_follow_dali():
    assert clip_starts(30, 4, stride=2, step=5) == [0, 5, 10, 15, 20]
    assert clip_starts(23, 4, stride=2) == [0, 4, 8, 12, 16]
    assert clip_starts(6, 4, stride=2) == []


@pytest.mark.parametrize("which", [0, 1], ids=["copied-vp8", "transcoded-h264"])
def test_torch_clips_decode_the_right_frames(index_datasets, which):
    ds = VideoClipDataset(index_datasets[which], sequence_length=4, stride=2, step=5)
    assert len(ds) == 5 + 4
    for i in range(len(ds)):
        clip, label = ds[i]
        assert tuple(clip.shape[:1]) == (4,) and clip.shape[-1] == 3
        assert frame_numbers(clip) == pytest.approx(ds.frame_indices(i), abs=0.5)
        assert label == (0 if i < 5 else 1)


def test_torch_dataloader_workers(index_datasets):
    import torch

    ds = VideoClipDataset(index_datasets[1], sequence_length=3, stride=1, step=7)
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2, shuffle=False)
    labels = torch.cat([lab for _, lab in loader]).tolist()
    assert labels == [ds[i][1] for i in range(len(ds))]
    halves = [VideoClipDataset(index_datasets[1], 3, 1, 7, shard_id=k, num_shards=2) for k in (0, 1)]
    assert list(halves[0].index) + list(halves[1].index) == list(ds.index) and ds.index == list(ds.index)


def test_dali_pipeline_matches_torch_sampling(index_datasets):
    from pipelines.dali_video import build_video_pipeline

    root = index_datasets[0]
    ds = VideoClipDataset(root, sequence_length=4, stride=2, step=5)
    pipe = build_video_pipeline(root, sequence_length=4, stride=2, step=5, batch_size=3, device="cpu",
                                device_id=None, reader="experimental", num_threads=1)
    seen = []
    for _ in range(3):
        frames, labels = pipe.run()
        for k in range(len(frames)):
            seen.append((int(np.asarray(labels[k]).ravel()[0]), frame_numbers(np.asarray(frames[k]))))
    expected = [(ds[i][1], [float(n) for n in ds.frame_indices(i)]) for i in range(len(ds))]
    assert [(lab, [round(x) for x in nums]) for lab, nums in seen] == [(lab, [round(x) for x in n]) for lab, n in expected]


def test_unlabeled_videos_are_minus_one_in_both_readers(tmp_path):
    from pipelines.dali_video import build_video_pipeline, video_inputs

    make_index_clip(tmp_path / "src/flat.webm", 8, VP8, size=(96, 64))  # no class folder: unlabeled
    out = tmp_path / "out"
    run_repack("video", tmp_path / "src", out, "--transcode", "--dali-reader", "experimental", "--quiet")
    ds = VideoClipDataset(out, sequence_length=4)
    assert [ds[i][1] for i in range(len(ds))] == [-1, -1]
    assert video_inputs(out)[1] == [-1]
    pipe = build_video_pipeline(out, sequence_length=4, batch_size=2, device="cpu", device_id=None,
                                reader="experimental", num_threads=1)
    _, labels = pipe.run()
    assert [int(np.asarray(labels[k]).ravel()[0]) for k in range(len(labels))] == [-1, -1]
    assert (out / "file_list.txt").read_text().split() == ["videos/flat.webm", "0"]  # DALI file_list: >= 0


def test_undecodable_clip_raises_runtime_error_naming_the_file(tmp_path):
    make_index_clip(tmp_path / "src/a/v.webm", 30, VP8, size=(96, 64))
    out = tmp_path / "out"
    run_repack("video", tmp_path / "src", out, "--transcode", "--dali-reader", "experimental", "--quiet")
    ds = VideoClipDataset(out, sequence_length=4, step=8)
    make_index_clip(out / "videos/a/v.webm", 10, VP8, size=(96, 64))  # the file lost its tail since
    with pytest.raises(RuntimeError, match="videos/a/v.webm"):
        for _ in ds:  # an IndexError would end this loop silently after 2 clips
            pass


def test_decision_per_dali_reader(tmp_path):
    """Legacy (default): only H.264 is kept, every other codec is transcoded (legacy_one_codec:
    fn.readers.video reads one codec per reader), whatever the other files are. Experimental:
    MJPEG is transcoded (its GPU decoder cannot create an NVDEC decoder for it), VP8 and H.264 are
    kept. An unknown reader is a usage error."""
    from repack.errors import UsageError
    from repack.transforms.nvdec_rules import DEFAULT_DALI_READER, decide
    from repack.transforms.probe import probe_file

    make_index_clip(tmp_path / "v.avi", 8, MJPEG, size=(96, 64))
    make_index_clip(tmp_path / "v.webm", 8, VP8, size=(96, 64))
    make_index_clip(tmp_path / "v.mp4", 8, ("-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"),
                    size=(96, 64))
    mjpeg, vp8, h264 = (probe_file(str(tmp_path / name)) for name in ("v.avi", "v.webm", "v.mp4"))
    assert DEFAULT_DALI_READER == "legacy"
    for info, label in ((mjpeg, "MJPEG"), (vp8, "VP8")):
        verdict = decide(info)
        assert verdict == decide(info, reader="legacy")
        assert verdict.decision == "transcode" and verdict.codes == ["legacy_one_codec"]
        assert verdict.reasons[0]["message"].startswith(f"{label}: DALI's legacy fn.readers.video reads one codec")
    assert decide(h264).decision == "ok" and decide(h264).reasons == ()
    verdict = decide(mjpeg, reader="experimental")
    assert verdict.decision == "transcode" and verdict.codes == ["codec"]
    assert "experimental" in verdict.reasons[0]["message"] and "MJPEG" in verdict.reasons[0]["message"]
    assert decide(vp8, reader="experimental").decision == decide(h264, reader="experimental").decision == "ok"
    with pytest.raises(UsageError, match="dali-reader"):
        decide(mjpeg, reader="nvdec")


def test_manifest_records_the_reader_and_the_pipeline_reads_every_ok_file(tmp_path):
    """Judged for the legacy reader (the default): VP8/VP9/MJPEG all become H.264; probe.jsonl and
    the manifest name the reader, and pipelines.dali_video reads with it by default, on the GPU
    only (a CPU device is a clear error). Judged for the experimental reader: MJPEG is transcoded,
    VP8/VP9 kept; the pipeline reads with it by default (here on DALI's CPU backend, which decodes
    VP8/VP9) and decodes the whole mixed dataset in one pass. A manifest without the field
    (written before it existed) means legacy."""
    import json

    from pipelines.dali_video import build_video_pipeline, dataset_reader

    have = encoders()
    codecs = {name: args for name, args in {"vp8.webm": VP8, "vp9.webm": VP9}.items() if args[1] in have}
    for name, args in codecs.items():
        make_index_clip(tmp_path / "src/ok" / name, 12, args, size=(160, 128))
    make_index_clip(tmp_path / "src/mj/v.avi", 12, MJPEG, size=(96, 64))
    for reader in ("legacy", "experimental"):
        out = tmp_path / f"probe-{reader}"
        run_repack("video", tmp_path / "src", out, "--dali-reader", reader, "--quiet")
        probes = [json.loads(x) for x in (out / "probe.jsonl").read_text().splitlines()]
        assert {p["dali_reader"] for p in probes} == {reader}
        assert {p["source"]: p["decision"] for p in probes} == {
            "mj/v.avi": "transcode", **{f"ok/{n}": "transcode" if reader == "legacy" else "ok" for n in codecs}}
    legacy = tmp_path / "legacy-out"
    run_repack("video", tmp_path / "src/ok", legacy, "--transcode", "--quiet")
    manifest = json.loads((legacy / "manifest.json").read_text())
    assert manifest["dali_reader"] == dataset_reader(legacy) == "legacy" and manifest["totals"]["ok"] == 0
    assert {e["codec"] for e in manifest["shards"]} == {"h264"} and all(e["transcoded"] for e in manifest["shards"])
    with pytest.raises(ValueError, match="GPU only"):
        build_video_pipeline(legacy, sequence_length=12, batch_size=1, device="cpu", device_id=None)
    del manifest["dali_reader"]
    (legacy / "manifest.json").write_text(json.dumps(manifest))
    assert dataset_reader(legacy) == "legacy"
    ok_only = tmp_path / "ok-out"
    run_repack("video", tmp_path / "src/ok", ok_only, "--transcode", "--dali-reader", "experimental", "--quiet")
    manifest = json.loads((ok_only / "manifest.json").read_text())
    assert manifest["dali_reader"] == dataset_reader(ok_only) == "experimental"
    assert manifest["totals"]["ok"] == len(codecs) and manifest["quarantine"] == []
    pipe = build_video_pipeline(ok_only, sequence_length=12, batch_size=len(codecs), device="cpu", device_id=None,
                                num_threads=1)  # reader=None: the manifest's
    frames, _ = pipe.run()
    for k in range(len(codecs)):
        assert frame_numbers(np.asarray(frames[k])) == pytest.approx(list(range(12)), abs=0.5)


def test_clip_splits_follow_dali_and_refuse_what_would_read_wrong_clips(index_datasets):
    """Parts start at size * k // num_shards as DALI's do (round() put a clip in another part); an out-of-range
    part was an empty epoch; a sampler splitting by rank over a split reader read a fraction of the clips; a
    state of a reader with another sequence length loaded when the clip counts happened to agree."""
    from pipelines.sampler_resume import ResumableSampler

    whole = VideoClipDataset(index_datasets[0], sequence_length=2, stride=1, step=1)
    size = len(whole)
    parts = [VideoClipDataset(index_datasets[0], 2, step=1, shard_id=k, num_shards=4).index for k in range(4)]
    assert [len(p) for p in parts] == [size * (k + 1) // 4 - size * k // 4 for k in range(4)]
    assert [c for p in parts for c in p] == whole.index
    for shard_id, num_shards in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="shard_id must be in"):
            VideoClipDataset(index_datasets[0], 2, shard_id=shard_id, num_shards=num_shards)
    with pytest.raises(ValueError, match="splits by rank itself"):
        ResumableSampler(size, rank=0, world_size=2, dataset=VideoClipDataset(index_datasets[0], 2, step=1,
                                                                              shard_id=0, num_shards=2))
    four = VideoClipDataset(index_datasets[0], sequence_length=4, stride=1, step=4)
    five = VideoClipDataset(index_datasets[0], sequence_length=5, stride=1, step=4)
    assert len(four) == len(five)  # the counts agree: only the options tell the states apart
    with pytest.raises(ValueError, match="other options loaded .*sequence_length: state 4, reader 5"):
        five.load_state_dict(four.state_dict())
    four.load_state_dict(VideoClipDataset(index_datasets[0], sequence_length=4, stride=1, step=4).state_dict())


def test_clip_columns_are_clip_starts_video_after_video():
    """The clip index is two int64 columns (no tuple per clip), the same clips in the same order as
    ``clip_starts`` of each video, for any stride and step, videos too short for a clip included."""
    from pipelines.torch_video import ClipIndex, clip_columns

    rng = np.random.default_rng(3)
    frames = [int(f) for f in rng.integers(0, 60, 40)] + [0, 7, 6]
    for length, stride, step in [(4, 2, 5), (4, 2, -1), (1, 1, 1), (3, 1, 2), (8, 3, 0)]:
        videos, starts = clip_columns(frames, length, stride, step)
        expected = [(v, s) for v, f in enumerate(frames) for s in clip_starts(f, length, stride, step)]
        assert videos.dtype == starts.dtype == np.int64
        assert list(zip(videos.tolist(), starts.tolist())) == expected
        index = ClipIndex(videos, starts)
        assert len(index) == len(expected) and [index[i] for i in range(len(index))] == expected
        with pytest.raises(IndexError):
            index[len(expected)]
        with pytest.raises(TypeError):
            index[1.0]
        assert list(index[1:4]) == expected[1:4] and index + index[:2] == expected + expected[:2]
    videos, starts = clip_columns([], 4)
    assert len(videos) == len(starts) == 0
