# turbokv: the whole set-up on a fresh machine is `make demo` and `make test`.
BUILD_DIR ?= build
JOBS ?= 2
CMAKE_FLAGS ?=

.PHONY: all deps configure build test test-asan demo bench clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

configure: deps $(BUILD_DIR)/CMakeCache.txt

build: configure
	cmake --build $(BUILD_DIR) -j$(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j$(JOBS)

# The unit, integration and Python tests again under AddressSanitizer and
# UndefinedBehaviorSanitizer (clang-14), plus a minute of libFuzzer on the
# handler. CUDA is left out of this build.
ASAN_DIR ?= build-asan
test-asan: deps
	CC=clang-14 CXX=clang++-14 cmake -S . -B $(ASAN_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DTURBOKV_SANITIZE=ON -DTURBOKV_CUDA=OFF
	cmake --build $(ASAN_DIR) -j$(JOBS)
	cd $(ASAN_DIR) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j$(JOBS)

demo: build
	@scripts/demo.sh $(BUILD_DIR)

bench: build
	$(BUILD_DIR)/bench/codec_bench

clean:
	rm -rf $(BUILD_DIR)
