# Every target sets itself up on a fresh machine: Debian packages (ffmpeg, chromium), a virtualenv
# and the Python packages. torch is pinned to the CPU build before anything that depends on it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT    := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600  # waits for another apt
PYTEST_ARGS ?= -n 4 --dist loadfile   # whole files per worker (pytest-xdist): module fixtures built once; 4 workers
# whatever the cores: on 2, two workers left ~20% of the CPU idle while tests wait on subprocesses and servers

.PHONY: setup system-deps demo test bench lint clean

setup: $(STAMP)

# chromium: the HTML report's test loads it in a real headless browser
system-deps:
	@if ! command -v ffmpeg >/dev/null || ! command -v ffprobe >/dev/null || ! command -v tar >/dev/null \
	    || ! command -v chromium >/dev/null; then \
	  echo "installing Debian packages: ffmpeg tar chromium"; \
	  $(APT) update -qq && $(APT) install -y -qq --no-install-recommends ffmpeg tar chromium >/dev/null; \
	fi

$(STAMP): pyproject.toml Makefile $(wildcard docker/requirements*.txt) | system-deps
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	sed 's/\[[^]]*\]//' docker/requirements*.txt > $(VENV)/constraints.txt  # the images' pins, extras dropped
	$(BIN)/pip install -q --disable-pip-version-check -c $(VENV)/constraints.txt -e '.[pipelines,ray,s3,dev]'
	touch $@

demo: setup system-deps
	$(BIN)/python -m tests.tools.demo

test: setup system-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: setup system-deps
	$(BIN)/python -m tests.benchmarks.run_all

clean:
	rm -rf $(VENV) demo-out bench-out .pytest_cache
