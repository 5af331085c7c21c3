"""`repack text` on many small files in several pool shapes (processes x Rust threads), beside the bare script.

    python -m tests.tools.text_shapes WORK [--files N] [--shapes 16x1,8x2,4x4] [--rounds R] [--tree DIR ...]

WORK holds the data (N .txt files of ~700 B from ``tests.benchmarks.tiny_files``, made once, and GPT-2's
tokenizer.json) and the outputs. A shape ``PxT`` runs ``repack text SRC OUT --doc-per file --tokenizer TOK
--workers P`` with ``REPACK_TOKENIZER_THREADS=T`` (``repack.transforms.tokenizer_threads``; T = 0: no Rust pool,
each worker encodes on its own thread); ``auto`` runs it with neither (the default rule). Each round runs the bare script of the scale bench (``bench_scale.TOKENIZE_SCRIPT``,
one single-thread process per usable CPU) and then every shape of every TREE (a checkout run as
``python -m repack`` with that PYTHONPATH; default: this one), one at a time (their order turns each round), so a paired comparison
shares the machine's state. Per run one JSON line; at the end per (tree, shape) the best wall and CPU
seconds over the rounds, CPU microseconds per file, the largest summed RSS / PSS of the process tree
(``bench_scale.run_tree``'s 50 ms sampler) and the bare script's best wall over the shape's (>= 0.9 is
the issue's target). Every run's token count must equal the bare script's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from tests.benchmarks.bench_scale import TOKENIZE_SCRIPT, run_tree, usable_cpus, warm

ROOT = Path(__file__).resolve().parents[2]


def parse_shape(text: str) -> tuple[int, int] | None:
    """``"8x2"`` -> (8, 2); ``"auto"`` -> None."""
    if text == "auto":
        return None
    processes, _, threads = text.partition("x")
    shape = int(processes), int(threads)
    if shape[0] < 1 or shape[1] < 0:
        raise ValueError(f"shape {text!r}: processes must be >= 1, threads >= 0 (0: no Rust pool)")
    return shape


def prepare(work: Path, files: int) -> tuple[Path, Path]:
    """(the source folder of ``files`` tiny .txt files, GPT-2's tokenizer.json), made once under ``work``."""
    from tests.benchmarks.tiny_files import tiny_texts
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    src, marker = work / f"txt-{files}", work / f"txt-{files}.complete"
    if not marker.exists():
        shutil.rmtree(src, ignore_errors=True)
        tiny_texts(src, 0, files)
        marker.write_text("ok\n")
    tokenizer = work / "gpt2" / "tokenizer.json"
    if not tokenizer.exists():
        write_tokenizer(gpt2_tokenizer(), work / "gpt2")
    return src, tokenizer


def run_shape(tree: Path, src: Path, out: Path, tokenizer: Path, shape: tuple[int, int] | None) -> dict:
    """One `repack text` run of ``tree`` in ``shape``; its measures and tokens."""
    shutil.rmtree(out, ignore_errors=True)
    env = {"PYTHONPATH": str(tree)}
    args = [sys.executable, "-m", "repack", "text", str(src), str(out), "--doc-per", "file", "--tokenizer",
            str(tokenizer), "--quiet"]
    if shape is not None:
        args += ["--workers", str(shape[0])]
        env["REPACK_TOKENIZER_THREADS"] = str(shape[1])
    run = run_tree(args, quiet_stdout=True, cwd=tree, env=env)
    tokens = json.loads((out / "manifest.json").read_text())["totals"]["tokens"]
    shutil.rmtree(out, ignore_errors=True)
    return {"wall_s": round(run.wall, 3), "cpu_s": round(run.cpu, 3), "rss_mb": round(run.peak_rss / 1e6, 1),
            "pss_mb": round(run.peak_pss / 1e6, 1), "largest_mb": round(run.peak_largest / 1e6, 1), "tokens": tokens}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--shapes", default="auto", help="comma-separated PxT or auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tree", action="append", type=Path, help="a checkout to run (repeatable); default: this")
    args = parser.parse_args(argv)
    shapes = [(name, parse_shape(name)) for name in args.shapes.split(",")]
    trees = [t.absolute() for t in (args.tree or [ROOT])]
    work = args.work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    src, tokenizer = prepare(work, args.files)
    warm(src)
    cpus = usable_cpus()
    results: dict[tuple[str, str], list[dict]] = {}
    bare: list[dict] = []
    for round_number in range(args.rounds):
        b = run_tree([sys.executable, "-c", TOKENIZE_SCRIPT, str(tokenizer), str(src), str(cpus)])
        bare.append({"wall_s": round(b.wall, 3), "cpu_s": round(b.cpu, 3), "rss_mb": round(b.peak_rss / 1e6, 1),
                     "pss_mb": round(b.peak_pss / 1e6, 1), "tokens": json.loads(b.stdout)["tokens"]})
        print(json.dumps({"round": round_number, "run": "bare", **bare[-1]}), flush=True)
        for tree in trees[round_number % len(trees):] + trees[:round_number % len(trees)]:  # the order turns
            for name, shape in shapes:
                got = run_shape(tree, src, work / "out", tokenizer, shape)
                if got["tokens"] != bare[-1]["tokens"]:
                    raise RuntimeError(f"{tree} {name}: {got['tokens']} tokens, the bare script {bare[-1]['tokens']}")
                results.setdefault((str(tree), name), []).append(got)
                print(json.dumps({"round": round_number, "tree": str(tree), "shape": name, **got}), flush=True)
    bare_wall = min(b["wall_s"] for b in bare)
    summary = [{"tree": tree, "shape": name, "wall_s": min(r["wall_s"] for r in runs),
                "cpu_s": min(r["cpu_s"] for r in runs),
                "cpu_us_per_file": round(min(r["cpu_s"] for r in runs) / args.files * 1e6, 1),
                "rss_mb": max(r["rss_mb"] for r in runs), "pss_mb": max(r["pss_mb"] for r in runs),
                "bare_wall_s": bare_wall, "bare_cpu_s": min(b["cpu_s"] for b in bare),
                "vs_bare": round(bare_wall / min(r["wall_s"] for r in runs), 3)}
               for (tree, name), runs in results.items()]
    print(f"{args.files} files, {cpus} usable CPUs, {args.rounds} round(s); best of the rounds "
          f"(bare script: {bare_wall:.2f} s wall, {min(b['cpu_s'] for b in bare):.2f} CPU-s)", file=sys.stderr)
    for row in summary:
        print(json.dumps({"summary": True, **row}), flush=True)
    return summary


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
