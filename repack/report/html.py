"""One self-contained HTML page per report: inline CSS and SVG, no script, nothing fetched at
view time. `dataset_page` draws what `collect` gathered for a dataset (per modality);
`bench_page` draws a `repack bench` report (samples/s and wait share against workers)."""

from __future__ import annotations

import contextlib
import os
import re
from html import escape
from pathlib import Path

from repack.config import format_size
from repack.report import svg
from repack.report.collect import as_packed, bar_count

BALANCE_ROWS = 40  # classes drawn in "Class balance"; more are summed up in one line
EXCEPTION_NAME = re.compile(r"\b(?:[A-Z][A-Za-z]*\.)*[A-Z][A-Za-z]*(?:Error|Exception|Warning): ")

STYLE = """
body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1000px;color:#1f2937;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #e5e7eb}
.sub{color:#6b7280;margin:0 0 16px}.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #e5e7eb;border-radius:8px;padding:8px 14px;min-width:110px}
.card b{display:block;font-size:20px}.card span{color:#6b7280;font-size:12px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}td,th{border-bottom:1px solid #eee;padding:3px 10px;
text-align:left}th{background:#f9fafb}td.n{text-align:right;font-variant-numeric:tabular-nums}
h3{font-size:13px;margin:10px 0 4px;color:#374151}.grid{display:flex;flex-wrap:wrap;gap:8px 32px}
.empty{color:#6b7280}.note{background:#fff7e6;border-left:4px solid #e07b39;padding:6px 10px}
.thumbs{display:flex;flex-wrap:wrap;gap:6px;align-items:flex-start}.thumbs figure{margin:0;max-width:170px}
.thumbs img{display:block;border:1px solid #e5e7eb}figcaption{font-size:11px;color:#4b5563;overflow-wrap:anywhere;hyphens:none}
.nothumb{width:96px;min-height:64px;background:#f3f4f6;color:#6b7280;font-size:11px;padding:4px;box-sizing:border-box}
pre.doc{white-space:pre-wrap;font-size:12px;background:#f9fafb;border:1px solid #eee;padding:6px 10px;margin:4px 0 10px}
"""


def page(title: str, subtitle: str, body: list[str]) -> str:
    """A whole HTML document around ``body`` (already-escaped HTML fragments)."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            "<link rel=\"icon\" href=\"data:,\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{escape(title)}</h1><p class=\"sub\">{escape(subtitle)}</p>" + "".join(body) + "</body></html>\n")


def write_page(path: str | os.PathLike, html: str) -> None:
    """Write the page atomically (a temp file beside it, then rename); a name that is not UTF-8 (a lone
    surrogate, as Python reads such a byte) is written escaped, never an error."""
    from repack.errors import UsageError

    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(html, encoding="utf-8", errors="backslashreplace")  # a non-UTF-8 name: \udcff
        os.replace(tmp, target)
    except OSError as exc:  # the page's path, not the dataset (no folder made for it: a typo is named)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write the report {str(target)!r}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def cards(items: list[tuple[str, str]]) -> str:
    return '<div class="cards">' + "".join(f'<div class="card"><b>{escape(v)}</b><span>{escape(k)}</span></div>'
                                           for k, v in items) + "</div>"


def table(head: list[str], rows: list[list], numeric: set[int] = frozenset()) -> str:
    if not rows:
        return '<p class="empty">none</p>'
    cells = "".join("<tr>" + "".join(f'<td{" class=n" if i in numeric else ""}>{escape(str(c))}</td>'
                                     for i, c in enumerate(row)) + "</tr>" for row in rows)
    return "<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + f"</tr>{cells}</table>"


def section(title: str, *parts: str) -> str:
    return f"<section><h2>{escape(title)}</h2>{''.join(parts)}</section>"


def histogram_bars(rows: list[dict], edge=str, width: int = 640) -> str:
    return svg.bars([(f"{edge(r['from'])} - {edge(r['to'])}", bar_count(r)) for r in rows], width=width)


def side_by_side(*charts: tuple[str, str]) -> str:
    return '<div class="grid">' + "".join(f"<div><h3>{escape(t)}</h3>{c}</div>" for t, c in charts) + "</div>"


def counts_bars(counts: dict, limit: int = 30) -> str:
    return svg.bars([(str(k), v) for k, v in list(counts.items())[:limit]])


def _ms(us: float) -> str:
    return f"{us / 1000:.2f} ms"


def dataset_page(s: dict, samples: dict | None = None) -> str:
    """The report of one dataset (``s`` from ``repack.report.collect.collect``; ``samples`` from
    ``repack.report.samples.gather``: thumbnails, frames, document starts)."""
    shards = s["shards"]
    figures = [("samples", f"{s['samples']:,}"), (f"{shards['unit']}s", str(shards["count"])),
               ("size", format_size(shards["bytes"])), ("quarantined", str(s["quarantine"]["count"]))]
    body = [section("DAMAGED", f"<p>{escape(s['damaged'])}</p>")] if s.get("damaged") else []
    body += sample_sections(samples or {})
    body += {"images": _images, "text": _text, "video": _video}.get(s["modality"], lambda _: [])(s)
    quarantine = s["quarantine"]
    body.append(section(f"Quarantine ({quarantine['count']})",
                        counts_bars(quarantine["reasons"]) if quarantine["count"] else "",
                        table(["source", "reason"], [[q.get("source", "?") + (f":{q['line']}" if "line" in q else ""),
                                                      q.get("reason", "?")] for q in quarantine["listed"]])))
    body.append(section(f"{shards['unit'].capitalize()}s", table([f"{shards['unit']}s", "total", "smallest", "median", "largest"],
                                        [[shards["count"], format_size(shards["bytes"]), format_size(shards["min_bytes"]),
                                          format_size(shards["median_bytes"]), format_size(shards["max_bytes"])]],
                                        {0, 1, 2, 3, 4})))
    subtitle = (f"{s['modality']} / {s['format']}, manifest v{s['manifest_version']}, repack {s['tool_version']}"
                f"{', built in ' + format(s['run']['seconds'], '.1f') + ' s' if s['run'].get('seconds') else ''}")
    return page(f"repack report: {s['root']}", subtitle, [cards(figures)] + body)


def figure(uri: str | None, caption: str, note: str = "") -> str:
    """A thumbnail (a data: URI) with its caption; a grey box with ``note`` when there is none."""
    picture = (f'<img src="{escape(uri)}" alt="{escape(caption)}">' if uri
               else f'<div class="nothumb">{escape(note or "no thumbnail")}</div>')
    return f"<figure>{picture}<figcaption>{escape(caption)}</figcaption></figure>"


def sample_sections(samples: dict) -> list[str]:
    """The sections that show the data: thumbnails per class, quarantined inputs, video frames, text."""
    body = [f'<p class="note">{escape(samples["note"])}</p>'] if samples.get("note") else []
    if samples.get("classes"):
        grids = "".join(f"<h3>{escape(c['class'])} ({escape(str(c['index']))})</h3><div class=\"thumbs\">"
                        + "".join(figure(t.get("uri"), t["key"], t.get("error", "")) for t in c["thumbnails"])
                        + (f'<p class="empty">{escape(c["note"])}</p>' if c.get("note") else "")
                        + "</div>" for c in samples["classes"])
        body.append(section("Samples per class", *([f'<p class="sub">{escape(samples["classes_note"])}</p>']
                                                    if samples.get("classes_note") else []), grids))
    if samples.get("quarantined"):
        body.append(section("Quarantined inputs", '<div class="thumbs">' + "".join(
            figure(q.get("uri"), f"{q['source']}: {plain_reason(q['reason'])}", plain_reason(q.get("note", "")))
            for q in samples["quarantined"])
            + "</div>"))
    if samples.get("frames"):
        body.append(section("One frame per decision", '<div class="thumbs">' + "".join(
            figure(f.get("uri"), f"{f['decision']}: {f['source']}" + "".join(f"; {r}" for r in f["reasons"]),
                   f.get("note", "")) for f in samples["frames"]) + "</div>"))
    if samples.get("documents"):
        body.append(section("Document starts (decoded)", "".join(
            f"<h3>document {d['index']:,} ({d['tokens']:,} tokens)</h3>"
            f"<pre class=\"doc\">{escape(d['text'])}{' ...' if d['truncated'] else ''}</pre>"
            for d in samples["documents"])))
    return body


def class_balance(classes: dict[str, int], counts: dict[str, int]) -> list[str]:
    """Bars of samples per class: every class up to BALANCE_ROWS, else the largest ones and one line
    that sums up the rest (the page stays small whatever the class count)."""
    rows = [(f"{name} ({idx})", counts.get(name, 0)) for name, idx in classes.items()]
    if counts.get(""):
        rows.append(("unlabeled", counts[""]))
    if len(rows) <= BALANCE_ROWS:
        return [svg.bars(rows)]
    ranked = sorted(rows, key=lambda row: -row[1])
    rest = ranked[BALANCE_ROWS:]
    return [f'<p class="sub">the {BALANCE_ROWS} largest of {len(rows):,} classes; the other {len(rest):,} hold '
            f'{sum(n for _, n in rest):,} samples (from {min(n for _, n in rest):,} to {max(n for _, n in rest):,} '
            f'each; `repack inspect --json` lists every class)</p>', svg.bars(ranked[:BALANCE_ROWS])]


def plain_reason(text: str) -> str:
    """A reason as a user reads it: Python exception class names dropped ("OSError: x" -> "x")."""
    return EXCEPTION_NAME.sub("", text)


def _images(s: dict) -> list[str]:
    stats, timing = s["stats"], s["timing"]
    hist = stats.get("histograms", {})
    counts = stats.get("class_counts", {})
    body = []
    if s["classes"] or counts:
        body.append(section(f"Class balance ({len(s['classes']):,} classes)", *class_balance(s["classes"], counts)))
    since = as_packed(s)
    body.append(section(f"Source file sizes{since}", histogram_bars(hist.get("source_bytes", []), format_size)))
    body.append(section(f"Dimensions (px){since}", side_by_side(("width", histogram_bars(hist.get("width", []), width=440)),
                                                        ("height", histogram_bars(hist.get("height", []), width=440)))))
    pct = [[name, t["p50"], t["p90"], t["p99"], t["max"]] for name, t in
           (("read (ms)", timing.get("read_ms")), ("decode/check (ms)", timing.get("check_ms"))) if t]
    body.append(section("Read + decode time per sample",
                        histogram_bars(timing.get("sample_us_histogram", []), _ms),
                        table(["", "p50", "p90", "p99", "max"], pct, {1, 2, 3, 4}),
                        "<h3>slowest inputs</h3>",
                        table(["time", "source", "size", "width x height"],
                              [[_ms(e["us"]), e["source"], format_size(e["bytes"]), f"{e['width']}x{e['height']}"]
                               for e in timing.get("slowest", [])], {0, 2})))
    dups = stats.get("duplicates") or {}
    body.append(section(f"Exact duplicates ({dups.get('groups', 0)} groups, {dups.get('extra_copies', 0)} extra copies"
                        f"{', ' + str(dups['dropped']) + ' dropped by --dedup' if dups.get('dropped') else ''}"
                        f"{'; every group in ' + ', '.join(dups.get('files') or [dups['file']]) if dups.get('files') or dups.get('file') else ''})",
                        table(["sha256", "paths"], [[g["sha256"][:16], " = ".join(g["paths"])]
                                                    for g in dups.get("list", [])])))
    norm = stats.get("normalize")
    if norm:
        body.append(section(f"--normalize: {norm['converted']} converted, {norm['passed_through']} unchanged",
                            counts_bars(dict(sorted(norm["reasons"].items(), key=lambda kv: -kv[1])))))
    if stats.get("formats"):
        body.append(section("Formats", counts_bars(stats["formats"])))
    return body


def _text(s: dict) -> list[str]:
    stats, totals, tok = s["stats"], s["totals"], s["text"].get("tokenizer") or {}
    lengths = stats.get("document_tokens", {})
    files = stats.get("files") or {}
    body = [cards([("documents", f"{totals.get('documents', 0):,}"), ("tokens", f"{totals.get('tokens', 0):,}"),
                   ("input files", str(totals.get("files", files.get("count", "?")))),
                   ("dtype", str(s["text"].get("dtype"))), ("vocabulary", str(tok.get("vocab_size", "?")))]),
            section("Document length (tokens)", histogram_bars(stats.get("document_tokens_histogram", [])),
                    table(["p50", "p90", "p99", "max", "mean"],
                          [[lengths.get(k, "") for k in ("p50", "p90", "p99", "max", "mean")]], {0, 1, 2, 3, 4}))]
    if files:
        body.append(section(f"Tokens per file ({files['count']} files)",
                            histogram_bars(files.get("tokens_histogram", [])), "<h3>largest files</h3>",
                            svg.bars([(e["source"], e["tokens"]) for e in files.get("largest", [])],
                                     lambda v: f"{v:,.0f} tokens")))
    body.append(section("Tokenizer", table(["sha256", "vocab", "eos", "bos", "dtype", "Megatron --data-path"],
                                           [[str(tok.get("sha256", ""))[:16], tok.get("vocab_size"), tok.get("eos_token"),
                                             tok.get("bos_token"), s["text"].get("dtype"),
                                             s["text"].get("megatron_data_path")]])))
    return body


def _video(s: dict) -> list[str]:
    v = s["video"]
    body = [section(f"Decisions for target {s['options'].get('target', '?')} ({v['probed']} probed)",
                    counts_bars(v["decisions"])),
            section("Decisions by reason", counts_bars(v["reasons"])),
            section("Codecs, resolutions, keyframe gaps (GOP)", side_by_side(
                ("codec profile", table(["codec profile", "videos"], [[k, n] for k, n in v["codecs"].items()], {1})),
                ("resolution", table(["width x height", "videos"], [[k, n] for k, n in v["resolutions"].items()], {1})),
                ("longest keyframe gap", table(["gap", "videos"], [[k, n] for k, n in v["gop"].items()], {1})
                 + f'<p class="sub">longer than --max-gop {escape(str(s["options"].get("max_gop", "?")))} s: '
                 'transcode</p>'),
                ("pixel format", table(["pixel format", "videos"], [[k, n] for k, n in v["pixel_formats"].items()], {1})),
                ("frame rate", table(["frame rate", "videos"], [[k, n] for k, n in v["frame_rates"].items()], {1})))),
            section("Videos not decodable as is",
                    table(["source", "decision", "codec", "size", "max GOP (s)", "reasons"],
                          [[e["source"], e["decision"], e["codec"], e["size"], e["max_gop_s"], ", ".join(e["reasons"])]
                           for e in v["not_ok"]], {4}))]
    return body


def bench_page(report: dict) -> str:
    """`repack bench --html`: samples/s and wait share against workers (threads for DALI)."""
    rate: dict[str, list[tuple[float, float]]] = {}
    wait: dict[str, list[tuple[float, float]]] = {}
    rows = []
    for r in report["results"]:
        x = r["workers"] if r["kind"] == "dataloader" else r["threads"]
        knob = "workers" if r["kind"] == "dataloader" else "threads"
        name = f"{r['reader']}{' gpu' if r.get('device') == 'gpu' else ''} {knob}, batch {r['batch_size']}"
        if "error" in r:
            rows.append([name, x, "failed", "", "", r["error"]])
            continue
        rate.setdefault(name, []).append((x, r["samples_per_s"]))
        wait.setdefault(name, []).append((x, 100 * r["wait_share"]))
        util = "" if r.get("gpu_util_bound") is None else f"{100 * r['gpu_util_bound']:.0f}%"
        rows.append([name, x, f"{r['samples_per_s']:.1f}", f"{100 * r['wait_share']:.0f}%", util,
                     "fastest" if r == report.get("best") else ""])
    opts = report["options"]
    unit = (report.get("best") or {}).get("unit", "samples")
    notes = [f'<p class="note">{escape(n)}</p>' for n in report.get("warnings", []) + report.get("notes", [])]
    body = [cards([("usable CPUs", str(report["usable_cpus"])), ("steps", str(opts["steps"])),
                   ("compute ms/step", f"{opts['compute_ms']:g}"), ("device", str(opts["device"]))]),
            f'<p class="note">{escape(report["recommendation"])}</p>', *notes,
            section(f"{unit}/s against workers (DataLoader) or threads (DALI)",
                    svg.lines(rate, "workers / threads", f"{unit}/s", lambda v: f"{v:,.0f}")),
            section("Share of each step spent waiting for data",
                    svg.lines(wait, "workers / threads", "wait %", lambda v: f"{v:.0f}%", y_max=100)),
            section("All settings", table(["reader", "workers / threads", f"{unit}/s", "wait", "GPU util <=", ""],
                                          rows, {1, 2, 3, 4}))]
    return page(f"repack bench: {report['dataset']}", f"{report['modality']} / {report['format']}", body)
