# Two commands on a fresh machine:  make demo  (set up + train the default job)  |  make test
PYTHON ?= python3
# torch goes in first, pinned: a plain `pip install torch` (or one pulled in by deepspeed) fetches a
# multi-GB CUDA build. On a GPU machine pick your CUDA build: make TORCH="torch --index-url ..."
TORCH ?= torch==2.13.0
GPUS ?= 2
CONFIG ?= ds_configs/default.json

.PHONY: install demo test lint format

install:
	$(PYTHON) -m pip install --quiet $(TORCH)
	DS_BUILD_OPS=0 $(PYTHON) -m pip install --quiet -e '.[dev]'

demo: install
	deepspeed --num_gpus $(GPUS) scripts/train.py --config $(CONFIG) --resume

lint:
	ruff check .
	ruff format --check .

format:
	ruff format .
	ruff check --fix .

test: install lint
	$(PYTHON) -m pytest
