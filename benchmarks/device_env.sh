# Source this on the GPU machine (repo root): makes the checkout importable without
# installing (m3_kernels -> kernels/), adds jax-triton from carried wheels (.whl/),
# and sets the environment both frameworks need in one process.
mkdir -p /tmp/site
ln -sfn "$PWD/kernels" /tmp/site/m3_kernels
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# NVLink multicast stays off (the machine's policy; tensor-parallel workers inherit this environment)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
