"""What the process repack runs in must not change what it writes: the locale's file-name encoding (a Latin-1 or
ASCII locale: the command starts again in Python's UTF-8 mode), the umask (every file repack writes follows it),
and a signal whose raise some C code swallowed (the command still stops with the signal's exit code)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys

from tests.conftest import ROOT, read_manifest_json, run_repack, sample_paths
from tests.test_images_job import jpeg_bytes

ASCII_NAMES = {"LC_ALL": "C", "PYTHONUTF8": "0"}  # no C-locale coercion and no UTF-8 mode: file names are ASCII


def _odd_names_source(root):
    for cls, names in (("éclair", ["ımg.jpg", "İx.jpg", "plain.jpg"]), ("plain", ["a.jpg", "ü.jpg"])):
        (root / cls).mkdir(parents=True)
        for i, name in enumerate(names):
            (root / cls / name).write_bytes(jpeg_bytes(seed=len(cls) * 10 + i))
    return root


def _without_run(out) -> dict:
    data = read_manifest_json(out)
    data.pop("run", None)
    data["created_by"]["options"].pop("source", None)
    return data


def test_an_ascii_locale_packs_the_same_dataset_and_an_append_under_utf8_adds_only_the_new_file(tmp_path):
    """Under an ASCII locale a non-ASCII name failed its whole task (exit 4, the other image of the shard lost too);
    under Latin-1 the names were recorded garbled, so an append from a UTF-8 machine packed every one again."""
    src = _odd_names_source(tmp_path / "src")
    run_repack("images", src, tmp_path / "utf8", "--quiet")
    run_repack("images", src, tmp_path / "ascii", "--quiet", env=ASCII_NAMES)
    assert _without_run(tmp_path / "utf8") == _without_run(tmp_path / "ascii")
    assert (tmp_path / "utf8" / "shard-000000.tar").read_bytes() == (tmp_path / "ascii" / "shard-000000.tar").read_bytes()
    assert "éclair/ımg.jpg" in sample_paths(tmp_path / "ascii")
    (src / "éclair" / "ğ.jpg").write_bytes(jpeg_bytes(seed=99))
    done = run_repack("images", src, tmp_path / "ascii", "--append")
    assert "1 new sample(s), 6 in all" in done.stdout + done.stderr, done.stdout + done.stderr
    assert read_manifest_json(tmp_path / "ascii")["stats"]["class_counts"] == {"plain": 2, "éclair": 4}
    assert run_repack("verify", tmp_path / "ascii", env=ASCII_NAMES).returncode == 0


def test_every_file_written_follows_the_umask(tmp_path):
    """Under umask 077 the shards were 0600 but manifest.json (and the other files written whole) 0644."""
    src = _odd_names_source(tmp_path / "src")
    out = tmp_path / "out"
    subprocess.run(["sh", "-c", 'umask 077 && exec "$0" -m repack images "$1" "$2" --quiet', sys.executable, src, out],
                   cwd=ROOT, check=True, capture_output=True)
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert "manifest.json" in modes and "shard-000000.tar" in modes
    assert {rel: oct(mode) for rel, mode in modes.items() if mode & 0o077} == {}


SWALLOWING = """
import os, signal, sys, time
import repack.jobs.engine as engine
release = engine.release_memory
def swallowed_signal():  # as C code that clears errors does with the handler's raise (an import, a callback)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    except BaseException:
        pass
    release()
engine.release_memory = swallowed_signal
sys.argv = ['repack'] + sys.argv[1:]
from repack.cli import main
main()
"""


def test_a_signal_whose_raise_is_swallowed_still_stops_the_job_with_its_exit_code(tmp_path):
    """A SIGTERM whose handler ran inside code that swallowed its raise let the job run on, publish and exit 0."""
    src = _odd_names_source(tmp_path / "src")
    out = tmp_path / "out"
    stopped = subprocess.run([sys.executable, "-c", SWALLOWING, "images", str(src), str(out), "--log-json"],
                             capture_output=True, text=True, cwd=ROOT)
    assert stopped.returncode == 143, stopped.stderr
    events = [json.loads(line) for line in stopped.stderr.splitlines() if line.startswith("{")]
    assert events[-1]["event"] == "error" and "interrupted by SIGTERM" in events[-1]["message"]
    assert not (out / "manifest.json").exists()
    run_repack("images", src, out, "--quiet")
    assert len(sample_paths(out)) == 5 and run_repack("verify", out).returncode == 0


CONVERTING = SWALLOWING.replace("""    except BaseException:
        pass
    release()""", """    except BaseException as exc:
        raise ImportError('PyCapsule_Import could not import module "datetime"') from exc""")


def test_a_signal_whose_raise_became_another_error_still_ends_with_the_signals_exit_code(tmp_path):
    """The handler's raise inside numpy's import came out as an ImportError (its C code's), which ended the
    command in a traceback, exit 1."""
    src = _odd_names_source(tmp_path / "src")
    stopped = subprocess.run([sys.executable, "-c", CONVERTING, "images", str(src), str(tmp_path / "out")],
                             capture_output=True, text=True, cwd=ROOT)
    assert stopped.returncode == 143 and stopped.stderr.startswith("repack: interrupted by SIGTERM"), stopped.stderr
    assert "Traceback" not in stopped.stderr


EARLY_SIGINT = """
import builtins, os, signal, sys
real_import = builtins.__import__
def importing(name, *args, **kwargs):  # Ctrl-C while the command's modules are still being imported
    if name == "repack.commands.images" and not getattr(importing, "sent", False):
        importing.sent = True
        os.kill(os.getpid(), signal.SIGINT)
    return real_import(name, *args, **kwargs)
builtins.__import__ = importing
sys.argv = ["repack", "--help"]
from repack.entry import main
main()
"""


def test_ctrl_c_while_the_command_starts_ends_in_one_line():
    """A Ctrl-C in the first fraction of a second (the imports) printed a KeyboardInterrupt traceback."""
    done = subprocess.run([sys.executable, "-c", EARLY_SIGINT], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 130 and done.stderr == "repack: interrupted by SIGINT while starting; nothing was done\n", \
        done.stderr


def test_repack_called_from_another_program_under_an_ascii_locale_is_refused_not_started_twice(tmp_path):
    """Started again in UTF-8 mode, the host program ran twice (a wrapper's own work done again), and a script on
    stdin found stdin empty the second time: exit 0, the command never run."""
    wrapper = "print('host work'); import sys; sys.argv = ['repack', 'verify', '/nonexistent']\n" \
              "from repack.cli import main\nmain()\n"
    done = subprocess.run([sys.executable, "-"], input=wrapper, capture_output=True, text=True, cwd=ROOT,
                          env={**__import__("os").environ, **ASCII_NAMES})
    assert done.returncode == 2 and done.stdout == "host work\n" and "PYTHONUTF8=1" in done.stderr, done
