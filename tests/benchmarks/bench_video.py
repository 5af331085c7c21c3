"""Video benchmark: probe files/s per core (``probe_file``: PyAV in-process, vs the ffprobe
subprocess per file, alternated repeats, CPU time of the process and its children), `repack
video` probe-only files/s at 1, 2, 4, ... workers (REPACK_BENCH_PROBE_FILES short clips, copies
of the generated ones; default 600; ``--probe-only`` stops there), the cost of
``--verify decode`` (the packet scan, the default, vs the scan plus a full decode of every
frame), and transcode frames/s (`repack video --transcode` vs the same ffmpeg commands run by
hand), measured in the same run on the same generated clips; then `repack video --transcode
--threads 1` frames/s at 1, 2, 4, ... workers up to the usable CPUs (REPACK_BENCH_MAX_WORKERS
caps it) with the scaling efficiency fps(W) / (W x fps(1)). Sizes via REPACK_BENCH_VIDEO_FILES
(default 24; at least one transcode clip per usable CPU is made for the sweep)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from repack.transforms.decode_check import decode_check
import shutil
import statistics

from repack.transforms.probe import ffprobe_probe, probe_file
from repack.transforms.transcode import Recipe, build_command
from tests.benchmarks.bench_producer import usable_cpus, worker_sweep
from tests.tools.videos import make_index_clip

ROOT = Path(__file__).resolve().parents[2]


def _probe_clips(root: Path, n: int) -> list[Path]:
    """``n`` short clips (2 s, 320x240 H.264) for the probe measurements."""
    good = []
    for i in range(n):
        p = root / "probe" / f"c{i % 4}" / f"v{i:03d}.mp4"
        make_index_clip(p, 50, ("-c:v", "libx264", "-preset", "ultrafast", "-g", "25", "-pix_fmt", "yuv420p"),
                        size=(320, 240))
        good.append(p)
    return good


def _transcode_clips(root: Path, n: int) -> list[Path]:
    bad = []
    # Transcode inputs with real content and length (10 s of testsrc2, 640x360, High 10): flat
    # frames encode in no time and make repack's fixed per-file costs (two probes, sha256) look
    # larger than they are on real footage.
    seconds = int(os.environ.get("REPACK_BENCH_VIDEO_SECONDS") or 10)
    for i in range(max(2, n // 4, usable_cpus())):
        p = root / "tc" / f"c{i % 2}" / f"t{i:03d}.mp4"
        p.parent.mkdir(parents=True, exist_ok=True)
        if not p.exists():
            subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i",
                            f"testsrc2=size=640x360:rate=30:duration={seconds}", "-c:v", "libx264", "-preset",
                            "veryfast", "-pix_fmt", "yuv420p10le", str(p)], check=True)
        bad.append(p)
    return bad


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for children (microsecond resolution)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def probe_rates(paths: list[Path], repeats: int, passes: int = 10) -> dict:
    """Median files/s per core (files / CPU-s) and per wall second of ``probe_file`` (PyAV, over
    ``passes`` passes of ``paths``) and ``ffprobe_probe`` (one pass), alternated ``repeats``
    times; also whether the records agree."""
    runs: dict[str, list[tuple[float, float]]] = {"pyav": [], "ffprobe": []}
    records = {}
    for _ in range(repeats):
        for name, fn, times in (("ffprobe", ffprobe_probe, 1), ("pyav", probe_file, passes)):
            wall, cpu = time.perf_counter(), _cpu_seconds()
            for _ in range(times):
                records[name] = [fn(str(p)) for p in paths]
            n = len(paths) * times
            runs[name].append((n / (_cpu_seconds() - cpu), n / (time.perf_counter() - wall)))
    tool_keys = ("probe_tool", "probe_fallback")
    agree = sum({k: v for k, v in a.items() if k not in tool_keys} == {k: v for k, v in b.items() if k not in tool_keys}
                for a, b in zip(records["ffprobe"], records["pyav"]))
    tools = sorted({r["probe_tool"] for r in records["pyav"]})
    return {name: {"files_per_cpu_s": round(statistics.median(r[0] for r in rs), 1),
                   "files_per_s": round(statistics.median(r[1] for r in rs), 1)} for name, rs in runs.items()} | {
        "agree": f"{agree}/{len(paths)}", "tools": tools}


def probe_sweep(good: list[Path], work: Path, files: int) -> list[tuple[int, float, float]]:
    """(workers, files/s, efficiency) of probe-only `repack video` over ``files`` short clips
    (copies of ``good``) at 1, 2, 4, ... workers up to the usable CPUs."""
    src = work / "src"
    if not src.exists():
        for i in range(files):
            dst = src / f"c{i % 4}" / f"p{i:05d}.mp4"
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(good[i % len(good)], dst)
    cpus = min(usable_cpus(), int(os.environ.get("REPACK_BENCH_MAX_WORKERS") or usable_cpus()))
    results, rate1 = [], None
    for workers in worker_sweep(cpus):
        shutil.rmtree(work / f"out{workers}", ignore_errors=True)  # a fresh OUT: no --overwrite wipe timed
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "repack", "video", str(src), str(work / f"out{workers}"), "--workers",
                        str(workers), "--quiet"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        rate = files / (time.perf_counter() - t0)
        rate1 = rate1 or rate
        results.append((workers, rate, rate / (workers * rate1)))
    return results


def transcode_sweep(src: Path, work: Path, frames: int) -> list[tuple[int, float, float]]:
    """(workers, frames/s, efficiency) of `repack video --transcode --threads 1` at 1, 2, 4, ... workers."""
    cpus = min(usable_cpus(), int(os.environ.get("REPACK_BENCH_MAX_WORKERS") or usable_cpus()))
    results, fps1 = [], None
    for workers in worker_sweep(cpus):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "repack", "video", str(src), str(work / str(workers)), "--transcode",
                        "--overwrite", "--workers", str(workers), "--threads", "1", "--quiet"], check=True, cwd=ROOT)
        fps = frames / (time.perf_counter() - t0)
        fps1 = fps1 or fps
        results.append((workers, fps, fps / (workers * fps1)))
    return results


def probe_part(out: Path, good: list[Path]) -> tuple[list[tuple[str, str, str]], dict]:
    """Table rows and result fields of the probe measurements."""
    rates = probe_rates(good, int(os.environ.get("REPACK_BENCH_REPEATS") or 3))
    sweep = probe_sweep(good, out / "probe-sweep", int(os.environ.get("REPACK_BENCH_PROBE_FILES") or 600))
    ff, pa = rates["ffprobe"]["files_per_cpu_s"], rates["pyav"]["files_per_cpu_s"]
    rows = [("probe ffprobe subprocess per file", f"{ff:.1f} files/CPU-s", "1.00"),
            (f"probe_file (PyAV), records agree {rates['agree']}", f"{pa:.1f} files/CPU-s", f"{pa / ff:.2f}")]
    rows += [(f"repack video (probe only), {w} worker(s)", f"{rate:.1f} files/s", f"eff {eff:.2f}")
             for w, rate, eff in sweep]
    return rows, {"probe_files": len(good), "probe": rates,
                  "probe_sweep": [{"workers": w, "files_s": round(rate, 1), "efficiency": round(eff, 3)}
                                  for w, rate, eff in sweep]}


def _table(rows: list[tuple[str, str, str]]) -> str:
    return "\n".join(f"{a:<46}{b:>18}{c:>10}" for a, b, c in [("video", "throughput", "ratio")] + rows)


def main(out_dir, probe_only: bool = False) -> dict:
    out = Path(out_dir).resolve() / "video"  # the commands run in the repo root: a relative OUT is the caller's
    n = int(os.environ.get("REPACK_BENCH_VIDEO_FILES") or 24)
    rows, result = probe_part(out, _probe_clips(out / "src", n))
    if probe_only:
        result["table"] = _table(rows)
        print(result["table"])
        (out / "result.json").write_text(json.dumps(result, indent=1))
        return result
    bad = _transcode_clips(out / "src", n)
    # --verify decode: the packet scan plus a full decode, on the transcode inputs (real content)
    t0 = time.perf_counter()
    scans = [probe_file(str(p)) for p in bad]
    t_scan = time.perf_counter() - t0
    t0 = time.perf_counter()
    checks = [decode_check(str(p), s.get("stream_index")) for p, s in zip(bad, scans)]
    t_decode = time.perf_counter() - t0 + t_scan
    assert all(c["decode_errors"] == 0 and c["decoded_frames"] == s["frames"] for c, s in zip(checks, scans))
    # transcode: repack (one worker, one thread) vs the identical commands by hand, sequentially
    frames = sum(probe_file(str(p))["frames"] for p in bad)
    dst = out / "repack-out"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "repack", "video", str(out / "src" / "tc"), str(dst), "--transcode",
                    "--overwrite", "--workers", "1", "--threads", "1", "--quiet"], check=True, cwd=ROOT)
    t_repack = time.perf_counter() - t0
    hand = out / "by-hand"
    hand.mkdir(parents=True, exist_ok=True)
    cmds = [build_command(str(p), str(hand / f"{i}.mp4"), probe_file(str(p)), Recipe()) for i, p in enumerate(bad)]
    t0 = time.perf_counter()
    for cmd in cmds:
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
    t_hand = time.perf_counter() - t0
    sweep = transcode_sweep(out / "src" / "tc", out / "sweep", frames)
    rows += [("verify packets (scan, the default)", f"{len(bad) / t_scan:.1f} files/s", "1.00"),
             ("verify decode (scan + full decode)", f"{len(bad) / t_decode:.1f} files/s", f"{t_scan / t_decode:.3f}"),
             ("transcode ffmpeg by hand", f"{frames / t_hand:.1f} frames/s", "1.00"),
             ("transcode repack (probe+encode+re-probe+sha)", f"{frames / t_repack:.1f} frames/s",
              f"{t_hand / t_repack:.2f}")]
    rows += [(f"transcode repack, {w} worker(s) x 1 thread", f"{fps:.1f} frames/s", f"eff {eff:.2f}")
             for w, fps, eff in sweep]
    table = _table(rows)
    print(table)
    result |= {"verify_files": len(bad), "verify_packets_files_s": round(len(bad) / t_scan, 2),
              "verify_decode_files_s": round(len(bad) / t_decode, 2),
              "verify_decode_cost_x": round(t_decode / t_scan, 1),
              "transcode_frames": frames, "transcode_hand_fps": round(frames / t_hand, 1),
              "transcode_repack_fps": round(frames / t_repack, 1),
              "sweep": [{"workers": w, "fps": round(fps, 1), "efficiency": round(eff, 3)} for w, fps, eff in sweep],
              "table": table}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--probe-only"]
    main(args[0] if args else "bench-out", probe_only="--probe-only" in sys.argv[1:])
