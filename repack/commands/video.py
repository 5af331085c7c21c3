"""The `repack video` command. Imports nothing heavy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from repack.commands.options import (LOCATION, engine_options, job_command, location, report, source_options,
                                     split_engine_options)
from repack.errors import UsageError
from repack.store import is_remote
from repack.transforms.nvdec_rules import DALI_READERS, DEFAULT_DALI_READER, DEFAULT_TARGET, TARGETS


@job_command("video", input=("list_file", "append"),
             output=("transcode", "to", "link", "crf", "preset", "gop", "max_height", "bframes", "shard_size"),
             checking=("target", "dali_reader", "verify", "max_gop"))
@click.argument("source", type=LOCATION)
@click.argument("out", type=LOCATION)
@click.option("--probe", is_flag=True,
              help="Probe every video and decide per file (every run does). Alone: probe only, report to "
                   "OUT/probe.jsonl and the manifest, write no videos. With --transcode: also prepare them.")
@click.option("--transcode", is_flag=True,
              help="After the probe, re-encode what needs it into OUT/videos and copy the rest (the full job: "
                   "`repack video SRC OUT --probe --transcode`).")
@click.option("--target", type=click.Choice(sorted(TARGETS)), default=DEFAULT_TARGET, show_default=True,
              help="GPU whose NVDEC (through DALI) must decode the videos.")
@click.option("--dali-reader", type=click.Choice(list(DALI_READERS)), default=DEFAULT_DALI_READER, show_default=True,
              help="DALI reader the videos must be read by (recorded in the manifest; pipelines.dali_video reads "
                   "with it): legacy = fn.readers.video, the fast one (about 4-12x), reads one codec per reader: "
                   "a dataset whose videos are all one codec it decodes and repack encodes (H.264, HEVC) keeps "
                   "that codec, any other dataset becomes H.264 (other codecs transcoded once: legacy_one_codec); "
                   "experimental = fn.experimental.readers.video, keeps mixed codecs as is (MJPEG is "
                   "transcoded) and reads them slower every epoch.")
@click.option("--verify", type=click.Choice(["packets", "decode"]), default="packets", show_default=True,
              help="packets: scan packet headers (fast); decode: also decode every frame and quarantine files "
                   "with decoder errors (slower, see make bench).")
@click.option("--max-gop", type=float, default=1.0, show_default=True,
              help="Longest keyframe gap (seconds) accepted as is; longer is transcoded.")
@click.option("--to", "to", type=click.Choice(["videos", "webdataset"]), default="videos", show_default=True,
              help="videos: files under OUT/videos; webdataset: also tar shards (+ .idx) of them.")
@click.option("--list", "list_file", is_flag=True, help="SOURCE is a .csv/.tsv/.jsonl list (path[,label]).")
@click.option("--link", is_flag=True, help="Hard-link compatible videos instead of copying them.")
@click.option("--append", is_flag=True,
              help="OUT holds a prepared video dataset: prepare only the videos it does not hold yet (same path, "
                   "size and mtime) into OUT/videos-vN (+ new shards) and publish them as its next version, with "
                   "the dataset's recorded codec (the legacy reader's one codec is not decided again).")
@click.option("--crf", type=int, default=18, show_default=True, help="x264 quality (lower = better, bigger).")
@click.option("--preset", default="fast", show_default=True, help="x264 preset.")
@click.option("--gop", type=int, default=None, help="Keyframe interval in frames (default: 1 s, capped by --max-gop).")
@click.option("--max-height", type=int, default=None,
              help="Scale taller videos down to this height (a taller compatible video is transcoded too: too_tall).")
@click.option("--bframes", type=int, default=0, show_default=True, help="B-frames in transcoded output.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="ffmpeg threads per transcode (fixed: the output depends on it); the default pool is CPUs/threads.")
@click.option("--shard-size", type=int, default=8, show_default=True,
              help="Videos per tar shard (--to webdataset); every video is a task of its own.")
@source_options
@engine_options(strict_also=" (probe only: or needs transcoding)")
def video(source, out, probe, transcode, target, dali_reader, verify, max_gop, to, list_file, link, append, crf,
          preset, gop, max_height, bframes, threads, shard_size, no_follow, allow_outside, **kwargs):
    """Probe the videos in SOURCE for GPU decoding; with --transcode, write DALI-ready videos to OUT.

    `repack video SRC OUT --probe --transcode` probes every video, decides, transcodes what the
    target cannot decode and copies the rest; without --transcode (with or without --probe) the
    run only probes and reports."""
    del probe  # every run probes; --transcode alone decides whether videos are written
    from repack.exec import available_cpus
    from repack.jobs.engine import Engine
    from repack.jobs.video import VideoJob, VideoSpec

    options = split_engine_options(kwargs)
    if is_remote(source):
        raise UsageError(f"repack video probes local files with ffprobe: SOURCE must be a local folder or list, "
                         f"not {source!r} (OUT may be s3://)")
    if transcode and options.workers is None:
        options = dataclasses.replace(options, workers=max(1, available_cpus() // threads))
    spec = VideoSpec(source=str(Path(source).absolute()), out=location(out), to=to,
                     list_file=list_file, transcode=transcode, link=link, target=target, max_gop=max_gop, crf=crf,
                     preset=preset, gop=gop, max_height=max_height, bframes=bframes, threads=threads,
                     shard_size=shard_size, verify=verify, dali_reader=dali_reader,
                     follow_symlinks=not no_follow, allow_outside_source=allow_outside)
    if append:
        from repack.commands.versions import run_append
        from repack.lifecycle.publish import current_version
        from repack.store import open_store

        codec = current_version(open_store(spec.out))[0].get("codec", "h264")
        run_append(spec, options, f"; codec {codec} kept from the dataset's recorded decision (the legacy "
                                  "reader's one codec), not decided again")
        return
    job = VideoJob(spec)
    result = Engine(job, options).run()
    manifest = result.manifest
    if options.json_summary and manifest is not None:
        click.echo(json.dumps({"out": job.store.url, "ran": result.ran, "skipped": result.skipped,
                               "seconds": round(result.seconds, 3), "totals": manifest["totals"],
                               "decisions": manifest["stats"]["decisions"], "reasons": manifest["stats"]["reasons"],
                               "quarantine": manifest["quarantine"], "probe": f"{job.store.url}/probe.jsonl"},
                              sort_keys=True))
        if not options.quiet:
            click.echo("\n".join(job.summary_lines(manifest)), err=True)
    else:
        report(job, options, result)
