# Source this on the GPU machine (repo root): makes the checkout importable without
# installing (m3_kernels -> kernels/), adds jax-triton from carried wheels (.whl/),
# and sets the environment both frameworks need in one process.
mkdir -p /tmp/site
ln -sfn "$PWD/kernels" /tmp/site/m3_kernels
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# CuTeDSL (optional, backend="cutedsl"): wheels carried in two calls by ../shared/tools/gpu-wheels.sh --cutedsl
# (call 1 left .whl-cute1/* in /tmp/cute; this call carries .whl-cute2 with the rest of the cu13 wheel)
if [ -f /tmp/cute/cu13.part.aa ] && [ -f .whl-cute2/cu13.part.ab ]; then
  cat /tmp/cute/cu13.part.aa .whl-cute2/cu13.part.ab \
    > /tmp/cute/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl && rm /tmp/cute/cu13.part.aa
fi
if ls /tmp/cute/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/nvidia_cutlass_dsl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/cute/*.whl
fi
CUTE_PATH=""
[ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && CUTE_PATH="/tmp/site/nvidia_cutlass_dsl/dsl_packages:"
export PYTHONPATH="/tmp/site:$CUTE_PATH$PWD:${PYTHONPATH:-}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# NVLink multicast stays off (the machine's policy; tensor-parallel workers inherit this environment)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
