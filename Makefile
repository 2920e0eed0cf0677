PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Tests and tools must never reach a model hub.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: setup setup-openvino setup-sdcpp test run bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned, so that no CUDA wheels are pulled on a CPU machine
	$(BIN)/pip install --quiet torch==2.13.0

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[test,server,ray,control]'
	# the web page's browser test drives Debian's chromium (Playwright's own browser download cannot work offline)
	command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; }
	touch $@

setup: $(VENV)/.installed

# OpenVINO for `make bench` alone (bench/openvino.py), in a virtualenv of its own: optimum-intel pins an older
# transformers than the tests do, and requires torchvision. torch first, pinned, and torchvision without its
# dependencies, so that no CUDA wheels of torch are pulled. The torchvision wheel found is a CUDA build whose operators
# do not load against the CPU torch; nothing on the Stable Diffusion path uses it, so the check (and
# bench/openvino.py) hide it.
OV_VENV := .venv-openvino
$(OV_VENV)/.installed:
	$(PY) -m venv $(OV_VENV)
	$(OV_VENV)/bin/pip install --quiet torch==2.13.0
	$(OV_VENV)/bin/pip install --quiet --no-deps torchvision==0.28.0
	$(OV_VENV)/bin/pip install --quiet "optimum-intel[openvino,diffusers]==2.2.0" torch==2.13.0 torchvision==0.28.0 psutil
	$(OV_VENV)/bin/python -c "import sys; sys.modules['torchvision'] = None; \
		from optimum.intel import OVStableDiffusionPipeline"
	touch $@

setup-openvino: $(OV_VENV)/.installed

# stable-diffusion.cpp for bench/sdcpp.py and bench/flux.py alone, in a virtualenv of its own: PyPI's stable-diffusion-cpp-python built
# from source (cmake and a C++ compiler; about 15 minutes on 2 cores) with GGML_NATIVE, so ggml uses this CPU's ISA
SDCPP_VENV := .venv-sdcpp
$(SDCPP_VENV)/.installed:
	$(PY) -m venv $(SDCPP_VENV)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(SDCPP_VENV)/bin/pip install --quiet --no-binary stable-diffusion-cpp-python \
		"stable-diffusion-cpp-python==0.4.7"
	$(SDCPP_VENV)/bin/python -c "from stable_diffusion_cpp import StableDiffusion"
	touch $@

setup-sdcpp: $(SDCPP_VENV)/.installed

# The modules of tiny models run on one torch thread each (tests/conftest.py marks their tests one_thread): two
# at a time, one a core (pytest-xdist, whole modules per worker, so their fixtures are built once); then the rest,
# which use both cores themselves, one at a time;
# then the CPU-dependent tests again as an AVX2-only CPU runs them (no AVX-512, no VNNI: 7-bit int8
# activations, no prepacking by default), by capping oneDNN's and PyTorch's kernels on this one; the Winograd
# convolutions and the chunked text encoding, whose summation orders follow the kernels, with them; and the
# precision policy, whose auto is exact there and which refuses bf16; the hand-written kernels, which stand aside; and
# TAESD in bf16, whose fused oneDNN convolutions stand aside there too
test: setup
	$(BIN)/python -m pytest -q -ra -n 2 --dist loadfile -m one_thread
	$(BIN)/python -m pytest -q -ra -m "not one_thread"
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(BIN)/python -m pytest -q -ra \
		tests/test_cpu.py tests/test_quant.py tests/test_packing.py tests/test_sdxl_engine_paths.py \
		tests/test_winograd.py tests/test_conditioning.py tests/test_precision.py tests/test_kernels.py \
		tests/test_kernels_fp32.py tests/test_dit_int8.py tests/test_transformer_kernels.py tests/test_dequant_kernel.py \
		tests/test_taesd.py::test_bf16_runs_fused_convolutions_close_to_the_unfused_and_to_diffusers

# one image from the shipped demo model, no download: prints where the PNG is
run: setup
	$(BIN)/sdlite generate "a red circle on a blue background" --seed 1 --output outputs/

# sdlite against diffusers on a cached full-size SD 1.5 checkpoint, then SDXL and OpenVINO; writes BENCHMARKS.md (hours on 2 cores)
bench: setup setup-openvino setup-sdcpp
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python bench/run.py
	$(BIN)/python bench/sdxl.py
	# sdlite against OpenVINO (default and f32), 3 alternating rounds; the OpenVINO section of BENCHMARKS.md
	$(BIN)/python bench/openvino.py
	# the same under the AVX2 caps, as a CPU without native bf16 runs it (default fp32-fast against OpenVINO f32)
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(BIN)/python bench/openvino.py \
		--configs 'sdlite default,sdlite exact,OpenVINO f32' --json bench/results-openvino-avx2.json
	# the few-step table (1 and 4 steps, warm and cold, TAESD and VAE) for sdlite, OpenVINO and stable-diffusion.cpp;
	# its section of BENCHMARKS.md, bench/fewstep.json
	$(BIN)/python bench/fewstep.py
	# the precision policy: UNet step per precision, the default's PSNR against exact (SD 1.5, demo)
	$(BIN)/python bench/precision.py all
	# Winograd against the direct convolutions, layer by layer, natively and under the AVX2 cap
	$(BIN)/python bench/winograd.py > bench/winograd.md
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(BIN)/python bench/winograd.py --isa-label avx2 >> bench/winograd.md
	# serve --ray and batch --ray against the single-process server; writes bench/scale.md
	$(BIN)/python bench/scale.py
	# the hires fix and upscalers, then one ControlNet's cost per step beside diffusers and memory mode 0 with one
	$(BIN)/python bench/hires.py all
	$(BIN)/python bench/controlnet.py all
	# the test suite's parity cases against diffusers at the real SD 1.5 / 2.1 shapes (the tests run them on tiny
	# models); writes bench/parity.json and bench/parity.md, fails when a case is outside its bound
	$(BIN)/python bench/parity.py
	# Z-Image-Turbo against diffusers bf16 (and stable-diffusion.cpp at the released depth only), 512^2, 8 steps; its
	# section of BENCHMARKS.md, bench/zimage.json. 15 of the 30 joint blocks at the released widths, so that a whole
	# bf16 pipeline (7 GB of transformer beside Qwen3-4B's 8 GB) fits in 24 GB; without --layers on a larger machine
	$(BIN)/python bench/zimage.py --layers 15
	# FLUX.2 [klein] 4B against diffusers bf16 (and stable-diffusion.cpp), 512^2, 4 steps; its section of BENCHMARKS.md,
	# bench/klein.json. At the released depth: 7.8 GB of transformer beside Qwen3-4B's 8 GB fits in 24 GB
	$(BIN)/python bench/klein.py
	# Qwen-Image-Edit-2509 against diffusers bf16 at the released widths, 2 of 60 blocks (and 2/4 of the encoder's 28
	# layers, the whole vision tower), 1024^2, from a folder, fp8 and GGUF files, memory modes 1 and 0; bench/edit.json
	$(BIN)/python bench/edit.py

clean:
	rm -rf $(VENV) $(OV_VENV) $(SDCPP_VENV) build *.egg-info
