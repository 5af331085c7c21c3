"""The `repack video` command. Imports nothing heavy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from repack.commands.options import engine_options, report, split_engine_options
from repack.errors import StrictModeError
from repack.transforms.nvdec_rules import DEFAULT_TARGET, TARGETS


@click.command("video")
@click.argument("source")
@click.argument("out")
@click.option("--probe", "probe_only", is_flag=True, help="Probe and decide only (the default without --transcode).")
@click.option("--transcode", is_flag=True, help="Re-encode what needs it into OUT/videos; copy the rest.")
@click.option("--target", type=click.Choice(sorted(TARGETS)), default=DEFAULT_TARGET, show_default=True,
              help="GPU whose NVDEC (through DALI) must decode the videos.")
@click.option("--max-gop", type=float, default=1.0, show_default=True,
              help="Longest keyframe gap (seconds) accepted as is; longer is transcoded.")
@click.option("--to", "to", type=click.Choice(["videos", "webdataset"]), default="videos", show_default=True,
              help="videos: files under OUT/videos; webdataset: also tar shards (+ .idx) of them.")
@click.option("--list", "list_file", is_flag=True, help="SOURCE is a .csv/.tsv/.jsonl list (path[,label]).")
@click.option("--link", is_flag=True, help="Hard-link compatible videos instead of copying them.")
@click.option("--crf", type=int, default=18, show_default=True, help="x264 quality (lower = better, bigger).")
@click.option("--preset", default="fast", show_default=True, help="x264 preset.")
@click.option("--gop", type=int, default=None, help="Keyframe interval in frames (default: 1 s, capped by --max-gop).")
@click.option("--max-height", type=int, default=None,
              help="Scale taller videos down to this height (a taller compatible video is transcoded too: too_tall).")
@click.option("--bframes", type=int, default=0, show_default=True, help="B-frames in transcoded output.")
@click.option("--threads", type=int, default=1, show_default=True,
              help="ffmpeg threads per transcode (fixed: the output depends on it); the default pool is CPUs/threads.")
@click.option("--shard-size", type=int, default=8, show_default=True,
              help="Videos per tar shard (--to webdataset); every video is a task of its own.")
@engine_options
def video(source, out, probe_only, transcode, target, max_gop, to, list_file, link, crf, preset, gop, max_height,
          bframes, threads, shard_size, **kwargs):
    """Probe the videos in SOURCE for GPU decoding; with --transcode, write DALI-ready videos to OUT."""
    del probe_only  # every run probes; --probe only spells out the default (report without transcoding)
    from repack.exec import available_cpus
    from repack.jobs.engine import Engine
    from repack.jobs.video import VideoJob, VideoSpec

    options = split_engine_options(kwargs)
    if transcode and options.workers is None:
        options = dataclasses.replace(options, workers=max(1, available_cpus() // threads))
    spec = VideoSpec(source=str(Path(source).absolute()), out=str(Path(out).absolute()), to=to,
                     list_file=list_file, transcode=transcode, link=link, target=target, max_gop=max_gop, crf=crf,
                     preset=preset, gop=gop, max_height=max_height, bframes=bframes, threads=threads,
                     shard_size=shard_size)
    job = VideoJob(spec)
    result = Engine(job, options).run()
    manifest = result.manifest
    if options.json_summary and manifest is not None:
        click.echo(json.dumps({"out": str(job.out), "ran": result.ran, "skipped": result.skipped,
                               "seconds": round(result.seconds, 3), "totals": manifest["totals"],
                               "decisions": manifest["stats"]["decisions"], "reasons": manifest["stats"]["reasons"],
                               "quarantine": manifest["quarantine"], "probe": str(job.out / "probe.jsonl")},
                              sort_keys=True))
        if not options.quiet:
            click.echo("\n".join(job.summary_lines(manifest)), err=True)
    else:
        report(job, options, result)
    if options.strict and manifest is not None and not transcode and manifest["totals"]["needs_transcode"]:
        raise StrictModeError(f"--strict: {manifest['totals']['needs_transcode']} video(s) need transcoding "
                              f"(see {job.out / 'probe.jsonl'})")
