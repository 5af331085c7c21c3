"""What the version commands share: running an append and saying what was published."""

from __future__ import annotations

from repack.config import EngineOptions


def say_published(out: str, manifest: dict, published: bool, what: str, options: EngineOptions,
                  seconds: float, none_reason: str = "nothing new", command: str = "append",
                  extra: dict | None = None) -> None:
    """The version now published (with what it quarantined), or that none was: as ``say_summary`` says
    every job's summary (its JSON plus ``extra``)."""
    from repack.manifest.versions import number_of

    from repack.commands.options import ProcessEnd, say_summary
    from repack.jobs.summary import quarantine_lines

    number = number_of(manifest)
    quarantined = new_quarantine(manifest) if published else []
    if published:
        counted = f"; {len(quarantined)} quarantined" if command == "append" else ""
        message = "\n".join([f"published version {number} of {out}: {what}{counted} ({seconds:.1f} s)"]
                            + quarantine_lines(quarantined) + _data_path_line(out, manifest))
    else:
        message = f"{none_reason}: version {number} of {out} unchanged, nothing published"
    summary = {"out": out, "version": number, "published": published, "totals": manifest["totals"],
               "quarantine": quarantined, **(extra or {})}
    say_summary(message, summary, options, command, always=not published)
    # the version is published (or not) and every file the change wrote is closed: its threads are joined and
    # atexit handlers run at exit, the teardown of numpy's and the other modules skipped (~30 ms, 2-core VM)
    ProcessEnd.after_exit_handlers = True


def _data_path_line(out: str, manifest: dict) -> list[str]:
    """A token dataset's new Megatron --data-path (the version's prefixes: OUT/text_document alone no longer is)."""
    if manifest.get("format") != "memmap" or not manifest.get("shards"):
        return []
    from repack.sinks.megatron import megatron_data_path

    return [f"Megatron --data-path {megatron_data_path(manifest, out)}"]


def new_quarantine(manifest: dict) -> list[dict]:
    """The quarantine records the latest version added (an append's new inputs; none for a remove)."""
    from repack.manifest.versions import VERSION_KEY

    change = (manifest.get(VERSION_KEY) or {}).get("change") or {}
    added = change.get("quarantined", 0) if change.get("kind") == "append" else 0
    return manifest["quarantine"][len(manifest["quarantine"]) - added:] if added > 0 else []


def only_quarantined(manifest: dict) -> bool:
    """Whether the latest version is an append whose new inputs were all quarantined (no new sample)."""
    from repack.manifest.versions import VERSION_KEY

    change = (manifest.get(VERSION_KEY) or {}).get("change") or {}
    return change.get("kind") == "append" and change.get("added_samples") == 0 and change.get("quarantined", 0) > 0


def run_append(spec, options: EngineOptions, note: str = "") -> None:
    """`repack images|text|video --append` (``note``: said after the counts)."""
    from repack.errors import UsageError
    from repack.lifecycle.append import append

    if options.overwrite:  # one keeps the dataset, the other replaces it: neither is what both ask
        raise UsageError("--append adds to the dataset in OUT and --overwrite replaces it: pass one of them")
    result = append(spec, options)
    left_out = (f"; {result.removed_skipped} removed source(s) found again and left out"
                if result.removed_skipped else "")
    packed = ("0 new samples (nothing new was packed: every new input was quarantined)"
              if result.published and only_quarantined(result.manifest) else f"{result.added} new sample(s)")
    say_published(spec.out, result.manifest, result.published,
                  f"{packed}, {result.manifest['totals']['samples']} in all{left_out}{note}",
                  options, result.seconds, none_reason=f"nothing new{left_out}",
                  extra={"removed_skipped": result.removed_skipped})
