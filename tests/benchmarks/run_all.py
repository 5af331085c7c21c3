"""`make bench`: run every tests/benchmarks/bench_*.py and collect their results.

Usage: python -m tests.benchmarks.run_all [OUT_DIR] [--only NAME ...]

Each module exposes ``main(out_dir) -> dict`` (JSON-serializable; an optional ``"table"`` string
is printed in the final summary) and prints its own table of ratios against baselines
measured in the same run. Results go to OUT_DIR/results.json (default bench-out/). A failing
benchmark is recorded with its error; the others still run; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def discover() -> list[str]:
    """Names of the benchmark modules (``bench_images`` -> ``images``), sorted."""
    return sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="bench-out", help="where data and results go")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this benchmark (e.g. images); repeatable")
    args = parser.parse_args(argv)
    names = discover()
    wanted = [n.removeprefix("bench_") for n in args.only] or names
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(names)}")
    out_dir = Path(args.out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    from tests.tools.bytecode import compile_dependencies, compile_package

    compile_package()  # every benchmark measures the package as installed: byte-compiled
    compile_dependencies()  # and its dependencies as pip installs them (tests.tools.bytecode)
    results_path = out_dir / "results.json"
    try:
        results = json.loads(results_path.read_text()) if results_path.exists() else {}
    except ValueError:
        results = {}
    failed = []
    for name in wanted:
        print(f"\n=== bench {name} ===", flush=True)
        started = time.perf_counter()
        try:
            module = importlib.import_module(f"tests.benchmarks.bench_{name}")
            result = module.main(out_dir)
        except Exception as exc:  # noqa: BLE001 - one failing benchmark must not hide the others
            traceback.print_exc()
            failed.append(name)
            result = {"error": f"{type(exc).__name__}: {exc}"}
        results[name] = {"seconds": round(time.perf_counter() - started, 1), "cpus": len(os.sched_getaffinity(0)),
                         "result": result}
        results_path.write_text(json.dumps(results, indent=1, sort_keys=True, default=str) + "\n")
    print("\n=== summary ===")
    for name in wanted:
        result = results[name]["result"]
        text = result.get("table") if isinstance(result, dict) else None
        print(f"\n[{name}] ({results[name]['seconds']} s)")
        print(text if text else json.dumps(result, indent=1, sort_keys=True, default=str))
    print(f"\nresults: {results_path}")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    sys.exit(main())
