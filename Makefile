# Top-level wrapper around CMake. `make` builds into build/; `make test` runs the
# whole suite (release build with -Werror, then an ASan+UBSan build, then the
# Python tests in .venv); `make demo` runs the main job. Both run scripts/setup --python
# first, which installs what is missing (Debian packages, .venv) and is a no-op otherwise.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PREFIX ?= /usr/local
CMAKE_FLAGS ?=
# The tests that drive the threads (save thread, workers, I/O threads, an S3 client
# shared by threads, the drain) run under TSan.
TSAN_TESTS ?= test_async|test_roundtrip|test_maint|test_preselected|test_global_presel|test_delta_(policy|cadence|corrupt|kernels)|test_s3$$|test_s3_faults|test_tier_(drain|ranks|image)

.PHONY: all build setup test test-long test-c test-asan test-tsan test-python demo demo-full bench install clean format fuzz vecreport

all: build

build:
	@cmake -S . -B $(BUILD) -DCMAKE_INSTALL_PREFIX=$(PREFIX) $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

setup:
	@scripts/setup --python

test: setup
	@scripts/run-tests

# The same suite with the large trial counts of the randomized kill and race tests.
test-long: setup
	@AMBER_TRIALS=$${AMBER_TRIALS:-50} AMBER_KILL_ITERS=$${AMBER_KILL_ITERS:-200} scripts/run-tests

test-c:
	@$(MAKE) --no-print-directory build BUILD=build CMAKE_FLAGS="-DAMBER_WERROR=ON"
	@cd build && ctest --output-on-failure -j $(JOBS)

test-asan:
	@$(MAKE) --no-print-directory build BUILD=build-asan CMAKE_FLAGS="-DAMBER_WERROR=ON -DAMBER_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=Debug"
	@cd build-asan && ctest --output-on-failure -j $(JOBS)

test-tsan:
	@$(MAKE) --no-print-directory build BUILD=build-tsan CMAKE_FLAGS="-DAMBER_WERROR=ON -DAMBER_SANITIZE=thread -DCMAKE_BUILD_TYPE=Debug"
	@cd build-tsan && ctest --output-on-failure -j $(JOBS) -R '$(TSAN_TESTS)'

demo: setup build
	@scripts/demo

# The demo with more failure rates: SIGKILLed every 20, 10 and 50 steps.
demo-full: setup build
	@DEMO_KILL_EVERY=$${DEMO_KILL_EVERY:-20,10,50} scripts/demo

bench: build
	@$(BUILD)/amber bench --full

# Builds only what it installs (library, CLI, libamber_mpi where MPI is found), in a build
# directory of its own configured without tests, examples and libamber_cuda (which only
# the wheel carries), so it neither builds the test suite nor touches build/.
install:
	@cmake -S . -B $(BUILD)-install -DCMAKE_INSTALL_PREFIX=$(PREFIX) -DAMBER_TESTS=OFF -DAMBER_EXAMPLES=OFF -DAMBER_CUDA=OFF $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD)-install -j $(JOBS)
	@cmake --install $(BUILD)-install

fuzz:
	@$(MAKE) --no-print-directory build BUILD=build-fuzz CMAKE_FLAGS="-DCMAKE_C_COMPILER=clang -DAMBER_FUZZ=ON"

format:
	@clang-format -i include/*.h src/*.c src/*.h tools/*.c tools/*.h tests/*.c tests/*.h fuzz/*.c bench/*.c examples/*.c 2>/dev/null || true

# Shows which loops of the scan kernels the compiler vectorized (and for AVX2).
vecreport:
	@gcc -std=c11 -D_GNU_SOURCE -O3 -Iinclude -Isrc -fopt-info-vec-optimized -c src/scan.c -o /dev/null 2>&1 | sort -u

clean:
	rm -rf build build-asan build-tsan build-fuzz build-install
