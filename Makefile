# Two commands on a fresh machine:  make demo  (set up + train the default job)  |  make test
PYTHON ?= python3
# torch goes in first, pinned: a plain `pip install torch` (or one pulled in by deepspeed) fetches a
# multi-GB CUDA build. On a GPU machine pick your CUDA build: make TORCH="torch --index-url ..."
TORCH ?= torch==2.13.0
GPUS ?= 2
CONFIG ?= ds_configs/default.json
# pip extras of fathom; `make test` adds mpi (mpi4py, for the mpirun tests)
EXTRAS = dev
# Open MPI comes from the system's packages; apt-get needs root
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

M30K ?= data/multi30k
M30K_DATA = data-bin/multi30k_deen
M30K_RUN = checkpoints/multi30k_deen

.PHONY: install mpi daemons peers demo test lint format multi30k fairseq-env-background

# The last line compiles DeepSpeed's shared-memory all-reduce for CPU ranks once for this environment (about
# 1 min; nothing on a GPU machine) into the directory its ranks use (pipeline/world/deepspeed_op.py).
install:
	$(PYTHON) -m pip install --quiet $(TORCH)
	DS_BUILD_OPS=0 $(PYTHON) -m pip install --quiet -e '.[$(EXTRAS)]'
	$(PYTHON) -m fathom.pipeline.world.deepspeed_op

# mpirun for `mpirun -np N` and `deepspeed --launcher openmpi` (Debian/Ubuntu packages), installed only when
# missing; libopenmpi-dev lets pip build mpi4py where it has no wheel.
mpi:
	command -v mpirun >/dev/null || ($(SUDO) apt-get update && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y openmpi-bin libopenmpi-dev)

# sshd, pdsh, Slurm and munge for the tests that start real daemons in a temporary directory (tests/daemons.py;
# Debian/Ubuntu packages), installed only when missing; without them those tests skip, and fail in CI.
daemons:
	export PATH="$$PATH:/usr/sbin:/sbin"; for program in sshd ssh pdsh munged slurmctld slurmd srun sbatch; do \
		command -v $$program >/dev/null || missing=1; done; [ -z "$$missing" ] || ($(SUDO) apt-get update && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y openssh-server openssh-client pdsh slurm-wlm munge)

# torchscale, the reference the tests compare DeepNorm and Sub-LN with (and scripts/bench.py times). Without
# its dependencies: its pinned timm would pull torchvision and a CUDA torch, for a drop_path we stand in for
# (tools/torchscale_peer.py).
peers: install
	$(PYTHON) -m pip install --quiet --no-deps torchscale==0.3.0 fairscale==0.4.0

demo: install
	deepspeed --num_gpus $(GPUS) scripts/train.py --config $(CONFIG) --resume

lint:
	ruff check .
	ruff format --check .

format:
	ruff format .
	ruff check --fix .

# Two workers (pytest-xdist): most of the suite's time is processes starting, loading and waiting on
# each other, which a second worker overlaps even on 2 cores (22 min instead of 29 on a 2-core Xeon).
# fairseq's environment (tests/test_fairseq.py, test_bench_prepare.py) builds in the background from the
# start, so no worker waits minutes for it; a finished one is reused, and a failed build is retried and
# reported by the first test that needs it.
test: EXTRAS = dev,mpi
test: fairseq-env-background mpi daemons install peers lint
	$(PYTHON) -m pytest -n 2 --durations=25

fairseq-env-background:
	bash scripts/setup_fairseq_env.sh >/dev/null 2>&1 &

# The Multi30k De->En recipe (docs/MULTI30K.md): prepare, train, translate the test set with the best and the
# averaged last 5 checkpoints, score, plot.
$(M30K_DATA)/meta.json:
	$(PYTHON) scripts/prepare_data.py --src de --tgt en --train $(M30K)/train --valid $(M30K)/val \
		--test $(M30K)/test_2016_flickr --vocab-size 8000 --out $(M30K_DATA)

multi30k: install $(M30K_DATA)/meta.json
	deepspeed --num_gpus 1 scripts/train.py --config ds_configs/multi30k_deen.json --resume
	$(PYTHON) scripts/generate.py --checkpoint $(M30K_RUN) --tag best --data $(M30K_DATA) --subset test \
		--beam 4 --lenpen 0.6
	$(PYTHON) scripts/average_checkpoints.py --checkpoint $(M30K_RUN) --last 5 --force
	$(PYTHON) scripts/generate.py --checkpoint $(M30K_RUN) --tag avg_last5 --data $(M30K_DATA) --subset test \
		--beam 4 --lenpen 0.6 --output $(M30K_RUN)/generate-test-avg_last5.txt
	$(PYTHON) scripts/plot_metrics.py $(M30K_RUN) --title "Multi30k De-En"
