# leaflens: the two commands a newcomer needs are `make demo` and `make test`.
#
#   make demo                      synthetic leaves -> preprocess -> teacher -> distill -> export -> web app
#   make preprocess DATA=photos/ SIZE=128 [EXTRA="artifacts/corrections ..."]
#   make teacher | distill | export | serve
#
# Stage targets depend on the real files each stage writes, so an up-to-date stage is skipped.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LEAFLENS := $(PY) -m leaflens
ART ?= artifacts
SYNTH := $(ART)/synthetic
UNLABELED_FRACTION ?= 0.5
# The photos of the last preprocess (DATA, SIZE, EXTRA), remembered so that `make teacher`, `make distill`...
# after `make preprocess DATA=photos` go on with those photos instead of preprocessing the synthetic demo's
# over them; DATA=... on the command line wins, and `make clean` forgets them.
ifneq ($(words $(ART)),1)
$(error ART="$(ART)": make cannot take a folder with a space in its name; give another ART, or run the leaflens commands the README gives)
endif
REMEMBERED := $(ART)/.make-data.mk
-include $(REMEMBERED)
# Other photos named on the command line: the remembered extra folders (corrections of the old photos) and each
# stage's remembered options (.make-*.args, below) belonged to the old ones, and are forgotten.
ifneq ($(filter command line environment,$(origin DATA)),)
ifneq ($(REMEMBERED_DATA),)
ifneq ($(abspath $(DATA)),$(abspath $(REMEMBERED_DATA)))
DATA_CHANGED := yes
ifeq ($(filter command line environment,$(origin EXTRA)),)
EXTRA :=
endif
endif
endif
endif
DATA ?= $(SYNTH)
ifneq ($(words $(DATA)),1)
$(error DATA="$(DATA)": make takes one photo folder without spaces in its path; for this one run: leaflens preprocess --src "<folder>" --out $(ART)/dataset (README, "Using your own photos"))
endif
SIZE ?= 128
# Extra folders of labelled photos merged into DATA's classes (e.g. the web app's corrections folder).
EXTRA ?=
DATASET := $(ART)/dataset
TEACHER := $(ART)/teacher
STUDENT := $(ART)/student
EXPORT := $(ART)/export
# On the synthetic demo data the stages use shorter recipes (pipeline/distill_demo.toml: [teacher], [train]...),
# also when TEACHER_ARGS or DISTILL_ARGS are given, unless they name a --config of their own.
ifeq ($(abspath $(DATA)),$(abspath $(SYNTH)))
DEMO_RECIPE := --config pipeline/distill_demo.toml
else
DEMO_RECIPE :=
endif
TEACHER_ARGS ?=
DISTILL_ARGS ?=
EXPORT_ARGS ?=
# RESUME=1: the teacher and distill stages go on from an interrupted run's checkpoints (--resume) instead of
# starting over; they refuse, and say why, when there is none or it was for other data.
RESUME ?=
SERVE_ARGS ?=
EXTRAS ?= dev,serve-cpu,teacher

.PHONY: help venv test lint data preprocess teacher distill export serve demo demo-blocked clean FORCE \
	bench-engine bench-mnist bench-preprocess bench-loader bench-serve bench-ibeans bench-ood bench-insects bench-gpu gpu-check

help:
	@echo "make demo           the whole pipeline on the built-in synthetic leaves, then the web app"
	@echo "make test           the default test suite (creates $(VENV) on first use)"
	@echo "make data           generate the synthetic leaf photos into $(SYNTH)"
	@echo "make preprocess     DATA=<photo folder> SIZE=<pixels> [EXTRA=<corrections folder>] -> $(DATASET)"
	@echo "make teacher        teacher features -> $(TEACHER) (TEACHER_ARGS=--frozen|--onnx M|--train-cnn)"
	@echo "make distill        student, distilled and from scratch -> $(STUDENT) (DISTILL_ARGS=...)"
	@echo "make export         ONNX FP32/FP16 (+INT8 when within 1 point) + Triton repository -> $(EXPORT) (EXPORT_ARGS=...)"
	@echo "make serve          the local web app on 127.0.0.1:7860, serving the export as it is (SERVE_ARGS=\"--port 8080 ...\")"
	@echo "                    RESUME=1: go on from an interrupted teacher/distill; ART=<folder> instead of $(ART)"
	@echo "                    (paths with spaces: use the leaflens commands the README gives instead of make)"
	@echo "make venv           the virtual environment $(VENV) with leaflens installed from this folder"
	@echo "                    (EXTRAS=$(EXTRAS); on an NVIDIA machine e.g. EXTRAS=dev,gpu-cuda12,teacher)"
	@echo "make bench-engine   engine training-step speed (vs PyTorch when installed)"
	@echo "make bench-mnist    MNIST with the engine (MNIST=dir with the IDX files)"
	@echo "make bench-ibeans   iBeans teacher and students (IBEANS=dir with train/ val/ test/, default $(IBEANS))"
	@echo "make bench-ood      out-of-domain check on iBeans (IBEANS=..., as above)"
	@echo "make bench-insects  pest photos, students at 3 sizes (INSECTS=dir of <class>/ folders, default $(INSECTS))"
	@echo "make bench-preprocess | bench-loader | bench-serve | bench-gpu"
	@echo "make lint           ruff, then mypy on the leaflens package (.ci/typecheck)"
	@echo "make gpu-check      on an NVIDIA machine: install the GPU extra, then doctor, gpu tests, GPU benchmark"
	@echo "make clean          delete the stages' outputs under $(ART) (the web page's corrections stay)"

# The virtual environment is rebuilt when pyproject.toml changes, and when the project folder was moved or
# renamed: its stamp names the folder it was made in, and the editable install of leaflens points there
# (moved, \`python -m leaflens\` failed with "No module named 'leaflens.pipeline'").
VENV_MADE_IN := $(strip $(shell cat $(VENV)/.installed 2>/dev/null))
VENV_MOVED :=
ifneq ($(VENV_MADE_IN),)
ifneq ($(VENV_MADE_IN),$(CURDIR))
VENV_MOVED := FORCE
endif
endif
$(VENV)/.installed: pyproject.toml $(VENV_MOVED)
	$(if $(VENV_MOVED),@echo "$(VENV) was made in $(VENV_MADE_IN): installing leaflens again for $(CURDIR)")
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	echo "$(CURDIR)" > $@

venv: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q

# mypy sees the package as it installs (leaflens.engine = engine/, ...) through .ci/typecheck's symlink tree.
lint: $(VENV)/.installed
	$(PY) -m ruff check .
	PY=$(PY) .ci/typecheck

# ---- the pipeline ----------------------------------------------------------------------------
# The demo withholds the labels of UNLABELED_FRACTION of each class's photos (they go to $(SYNTH)/unlabeled/):
# distillation learns from the teacher on those photos, training from scratch cannot. synth does nothing when
# the folder already holds the same options, and makes it again when they changed.
$(SYNTH)/classes.toml: FORCE | $(VENV)/.installed
	$(LEAFLENS) data synth --out $(SYNTH) --unlabeled-fraction $(UNLABELED_FRACTION)

data: $(SYNTH)/classes.toml

# preprocess always looks at the photos (it does no work and keeps the manifest's time stamp when
# nothing changed), so later stages re-run only when the dataset really changed.
$(DATASET)/manifest.json: FORCE $(if $(filter $(abspath $(SYNTH)),$(abspath $(DATA))),$(SYNTH)/classes.toml) | $(VENV)/.installed
	@$(if $(DATASET_FOREIGN),echo "$(FOREIGN_SAYS)" >&2; exit 2)
	$(if $(DATA_CHANGED),@rm -f $(ART)/.make-*.args)
	$(LEAFLENS) preprocess --src $(DATA) --out $(DATASET) --size $(SIZE) $(foreach d,$(EXTRA),--also $(d))
	@printf 'DATA ?= %s\nSIZE ?= %s\nEXTRA ?= %s\nREMEMBERED_DATA := %s\n' '$(DATA)' '$(SIZE)' '$(EXTRA)' \
		'$(DATA)' > $(REMEMBERED)

preprocess: $(DATASET)/manifest.json

# Each stage's options (TEACHER_ARGS, DISTILL_ARGS, EXPORT_ARGS), when given on the command line (or in the
# environment), are kept in a file rewritten only when they change, so a stage whose options changed runs again
# (`make teacher TEACHER_ARGS=--frozen` after a fine-tune) instead of being skipped as up to date. A later
# `make distill` without TEACHER_ARGS leaves the file alone, so it does not remake the frozen teacher with the
# default options, and a stage remade for another reason (new photos) runs with the options in its file, the
# last ones given. The options travel in the environment: quotes in them stay as typed. A file missing while
# the options were not given is written dated 1970: outputs made before it existed are not remade for it.
# RESUME=1 gives --resume to the stages that have an interrupted run to go on from, and only to them.
$(ART)/.make-%.args: FORCE
	@mkdir -p $(@D); if [ "$$STAGE_GIVEN" = yes ]; then printf '%s\n' "$$STAGE_ARGS" | cmp -s - $@ 2>/dev/null \
	|| printf '%s\n' "$$STAGE_ARGS" > $@; elif [ ! -f $@ ]; then printf '%s\n' "$$STAGE_ARGS" > $@ \
	&& touch -t 197001010000 $@; fi
given = $(if $(filter command line environment,$(origin $(1))),yes)
$(ART)/.make-teacher.args: export STAGE_ARGS = $(TEACHER_ARGS)
$(ART)/.make-teacher.args: export STAGE_GIVEN = $(call given,TEACHER_ARGS)
$(ART)/.make-distill.args: export STAGE_ARGS = $(DISTILL_ARGS)
$(ART)/.make-distill.args: export STAGE_GIVEN = $(call given,DISTILL_ARGS)
$(ART)/.make-export.args: export STAGE_ARGS = $(EXPORT_ARGS)
$(ART)/.make-export.args: export STAGE_GIVEN = $(call given,EXPORT_ARGS)

# a stage's options: as given, else the last ones given (its file, unless dated 1970: defaults), else defaults
stage_args = $(if $(call given,$(2)),$($(2)),$(if $(shell find $(ART)/.make-$(1).args -newermt 1971-01-01 \
	2>/dev/null),$(shell cat $(ART)/.make-$(1).args),$($(2))))
# the demo's recipe before a stage's options, unless they give a --config of their own (one is read; argparse
# takes --conf for it too); the options otherwise as typed
with_recipe = $(if $(filter --con%,$(1)),,$(DEMO_RECIPE) )$(1)
TEACHER_WORK = $(wildcard $(dir $(TEACHER)).$(notdir $(TEACHER)).finetune-work $(dir $(TEACHER)).$(notdir $(TEACHER)).cnn-work)

$(TEACHER)/teacher.json: $(DATASET)/manifest.json $(ART)/.make-teacher.args
	$(LEAFLENS) teacher --dataset $(DATASET) --out $(TEACHER) $(if $(and $(RESUME),$(TEACHER_WORK)),--resume) \
		$(call with_recipe,$(call stage_args,teacher,TEACHER_ARGS))

teacher: $(TEACHER)/teacher.json

$(STUDENT)/best.npz: $(TEACHER)/teacher.json $(ART)/.make-distill.args
	$(LEAFLENS) distill --dataset $(DATASET) --teacher $(TEACHER) --out $(STUDENT) \
		$(if $(and $(RESUME),$(wildcard $(STUDENT).partial)),--resume) \
		$(call with_recipe,$(call stage_args,distill,DISTILL_ARGS))

distill: $(STUDENT)/best.npz

$(EXPORT)/student.onnx: $(STUDENT)/best.npz $(ART)/.make-export.args
	$(LEAFLENS) export --run $(STUDENT) --dataset $(DATASET) --out $(EXPORT) $(call stage_args,export,EXPORT_ARGS)

export: $(EXPORT)/student.onnx

SERVE_CMD = $(LEAFLENS) serve --model $(EXPORT)/student.onnx --corrections $(CORRECTIONS) $(SERVE_ARGS)
# serve: the exported model as it is, made first only when there is none. A machine that only serves (the model
# copied there) has no photos or stages to remake it from, and must never have it replaced by a retrained demo;
# `make export serve` (or `make demo`) brings the export up to date first, -j or not.
serve: $(if $(or $(filter export,$(MAKECMDGOALS)),$(if $(wildcard $(EXPORT)/student.onnx),,none)),$(EXPORT)/student.onnx) \
		| $(VENV)/.installed
	$(SERVE_CMD)

# `make demo` is the synthetic demo: after `make preprocess DATA=photos` the remembered photos' stages fill
# $(ART), and running the demo there would replace the model trained on them.
ifneq ($(abspath $(DATA)),$(abspath $(SYNTH)))
ifeq ($(origin DATA),file)
DEMO_BLOCKED := yes
DEMO_WHY := DATA=$(DATA), remembered since 'make preprocess'
endif
endif
# ... and so would it after `leaflens preprocess --src photos --out $(ART)/dataset` (a path make cannot take)
DATASET_SOURCE := $(shell sed -n 's/^ *"source_root": *"\(.*\)",*$$/\1/p' $(DATASET)/manifest.json 2>/dev/null)
ifeq ($(abspath $(DATA)),$(abspath $(SYNTH)))
ifneq ($(DATASET_SOURCE),)
ifeq ($(filter %/$(notdir $(SYNTH)),$(DATASET_SOURCE)),)
DEMO_BLOCKED := yes
DEMO_WHY := its dataset was made from $(DATASET_SOURCE)
ifeq ($(filter command line environment,$(origin DATA)),)
DATASET_FOREIGN := yes
FOREIGN_SAYS := make: $(DATASET) was made from $(DATASET_SOURCE) by leaflens preprocess, and make would replace it \
	with the synthetic demo's. Give DATA=<that folder> (no spaces), go on with the leaflens commands, or give the \
	demo another ART=<folder>
endif
endif
endif
endif

demo: $(if $(DEMO_BLOCKED),demo-blocked,$(EXPORT)/student.onnx)
	$(if $(DEMO_BLOCKED),,$(SERVE_CMD))

demo-blocked:
	@echo "make demo: $(ART) holds the stages of your own photos ($(DEMO_WHY));" >&2
	@echo "  the demo would replace the model trained on them. 'make serve' serves that model; for the synthetic" >&2
	@echo "  demo beside it: make demo ART=$(ART)/demo (or 'make clean' first, which deletes the stage outputs in $(ART))." >&2
	@exit 2

FORCE:

# ---- benchmarks ------------------------------------------------------------------------------
bench-engine: $(VENV)/.installed
	$(PY) benchmarks/engine_speed.py

MNIST ?= ../shared/data/mnist
bench-mnist: $(VENV)/.installed
	$(PY) benchmarks/mnist.py --data $(MNIST)

bench-preprocess: $(VENV)/.installed
	$(PY) benchmarks/preprocess.py

bench-loader: $(VENV)/.installed
	$(PY) benchmarks/loader.py

bench-serve: $(VENV)/.installed
	$(PY) benchmarks/serve.py

IBEANS ?= ../shared/data/ibeans
bench-ibeans: $(VENV)/.installed
	$(PY) benchmarks/ibeans.py --data $(IBEANS)

bench-ood: $(VENV)/.installed
	$(PY) benchmarks/ood.py --data $(IBEANS)

INSECTS ?= ../shared/data/insects
bench-insects: $(VENV)/.installed
	$(PY) benchmarks/insects.py --data $(INSECTS)

bench-gpu: $(VENV)/.installed
	$(PY) benchmarks/gpu.py

# The GPU stack in a venv of its own (a GPU extra must not sit beside .venv's serve onnxruntime): the driver's
# extra, PyTorch as the reference, then doctor --require-gpu, pytest -m gpu and benchmarks/gpu.py --require-gpu.
# Without a GPU it stops at once, before any download (.ci/gpu_check.py). GPU_CHECK_ARGS=--no-install: offline.
GPU_VENV ?= build/venv-gpu
GPU_CHECK_ARGS ?=
gpu-check:
	$(PYTHON) .ci/gpu_check.py --venv $(GPU_VENV) $(GPU_CHECK_ARGS)

# The stages' outputs only: photos people corrected on the web page ($(CORRECTIONS)) are their work, not an
# output, and stay.
CORRECTIONS := $(ART)/corrections
clean:
	rm -rf $(SYNTH) $(DATASET) $(TEACHER) $(STUDENT) $(EXPORT) $(REMEMBERED) $(ART)/.make-*.args .pytest_cache
	rm -rf $(dir $(TEACHER)).$(notdir $(TEACHER)).finetune-work $(dir $(TEACHER)).$(notdir $(TEACHER)).cnn-work \
		$(STUDENT).partial  # interrupted runs' checkpoints
	@if [ -d "$(CORRECTIONS)" ]; then echo "kept $(CORRECTIONS): the photos corrected on the web page (delete it yourself when they are no longer wanted)"; fi
