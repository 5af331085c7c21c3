"""tests/tools/cpu_timeline.py, the tool behind tests/gpu/text_cpu.sh: a process tree's CPU from /proc and rusage,
and the bare tokenizer script with its encode and read seconds, counting the tokens `repack text` counts."""

from __future__ import annotations

import json
import sys

from tests.conftest import read_manifest_json, run_repack
from tests.test_text_many_files import small_files
from tests.tools.cpu_timeline import BARE_TIMED, run
from tests.tools.text import gpt2_tokenizer, write_tokenizer

BUSY_CHILD = """
import multiprocessing, time
def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
if __name__ == "__main__":
    p = multiprocessing.get_context("fork").Process(target=burn, args=(0.6,))
    p.start(); p.join()
    burn(0.4)
    print("done")
"""


def test_the_tree_s_cpu_is_split_between_the_root_and_its_children():
    got = run([sys.executable, "-c", BUSY_CHILD], every=0.02, bucket=0.25)
    assert got["rc"] == 0 and got["stdout_tail"].strip() == "done"
    assert got["children_cpu_s"] >= 0.5  # the child's 0.6 s (rusage: waited for)
    assert 0.2 <= got["root_user_s"] + got["root_sys_s"] <= got["user_s"] + got["sys_s"] - 0.5
    assert got["threads_seen"] >= 2 and got["runqueue_wait_s"] >= 0
    assert max(n for *_, n in got["timeline"]) == 2  # the root and its child, seen together
    assert sum(cpus for _, cpus, _, _ in got["timeline"]) * 0.25 >= 0.6  # most of the CPU shows on the timeline


def test_the_timed_bare_script_counts_what_repack_text_counts(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    small_files(src, 60)
    tokenizer = write_tokenizer(gpt2_tokenizer(), tmp_path / "gpt2")
    got = run([sys.executable, "-c", BARE_TIMED, str(tokenizer), str(src), "2"])
    assert got["rc"] == 0
    bare = json.loads(got["stdout_tail"].strip().splitlines()[-1])
    assert bare["encode_seconds"] > 0 and bare["read_seconds"] > 0
    run_repack("text", src, out, "--tokenizer", tokenizer, "--doc-per", "file", "--quiet")
    assert read_manifest_json(out)["totals"]["tokens"] == bare["tokens"]
