#!/usr/bin/env bash
# Builds llama.cpp (CPU, with the RPC backend) from the llama-cpp-python sdist on PyPI into a
# cache folder, for the side-by-side benchmark and the numerics reference. Nothing it builds
# or downloads belongs in the repository.
#
#   bash benchmarks/build_llama_cpp.sh            # builds once, then prints the cached prefix
#   LLAMA_CPP_CACHE=/some/dir bash benchmarks/...  # choose where
#
# Produces $PREFIX/bin/{ggml-rpc-server,llama-bench,llama-cli,llama-completion,llama-server,
# llama-quantize,llama-imatrix},
# $PREFIX/lib/libllama.so (+ ggml libs) and $PREFIX/python/llama_cpp (the ctypes bindings of
# the same version, used with LLAMA_CPP_LIB_PATH=$PREFIX/lib).
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${LLAMA_CPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shardwire/llama.cpp}
PREFIX="$CACHE/$VERSION"
STAMP="$PREFIX/.built"

# Flags that keep -march=native off what this CPU lists and cannot run (AMX on some hosts), as
# shardwire's own ggml build chooses them (kernels/cpu_probe.py).
EXTRA_FLAGS=$(python3 "$(dirname "$0")/../kernels/cpu_probe.py")
TOOLS="ggml-rpc-server llama-bench llama-cli llama-completion llama-server llama-quantize llama-imatrix"
CONFIG="version=$VERSION native=ON extra=[$EXTRA_FLAGS] tools=[$TOOLS]"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$CONFIG" ]; then echo "$PREFIX"; exit 0; fi

mkdir -p "$CACHE/src"
SDIST="$CACHE/src/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/src" >&2
fi
SRC="$CACHE/src/llama_cpp_python-$VERSION"
[ -d "$SRC" ] || tar -xzf "$SDIST" -C "$CACHE/src"

BUILD="$CACHE/build-$VERSION"
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_RPC=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$EXTRA_FLAGS" -DCMAKE_CXX_FLAGS="$EXTRA_FLAGS" \
  -DCMAKE_INSTALL_PREFIX="$PREFIX" -DCMAKE_INSTALL_RPATH="$PREFIX/lib" >&2
# shellcheck disable=SC2086
cmake --build "$BUILD" -j "$(nproc)" --target $TOOLS >&2

mkdir -p "$PREFIX/bin" "$PREFIX/lib" "$PREFIX/python"
for t in $TOOLS; do
  cp "$BUILD/bin/$t" "$PREFIX/bin/"
done
find "$BUILD" -name '*.so*' -exec cp -P {} "$PREFIX/lib/" \;
rm -rf "$PREFIX/python/llama_cpp"
cp -r "$SRC/llama_cpp" "$PREFIX/python/llama_cpp"
echo "$CONFIG" > "$STAMP"
echo "$PREFIX"
