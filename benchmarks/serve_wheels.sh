#!/usr/bin/env bash
# The server's wheels for the GPU machine, whose image has no FastAPI/uvicorn/pydantic (run here, then
# carry .whl/ with the device call; benchmarks/device_env.sh installs everything in it). The versions are
# constraints.txt's; opentelemetry-api is a dependency of this FastAPI; pyzmq and msgspec carry the engine process's
# messages, xgrammar (and apache-tvm-ffi) the structured outputs.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
pins=$(grep -E '^(fastapi|uvicorn|pydantic|pydantic_core|annotated-doc|annotated-types|typing-inspection|starlette|anyio|idna|sniffio|click|h11|typing_extensions|opentelemetry-api|pyzmq|msgspec|xgrammar|apache-tvm-ffi)==' constraints.txt)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl $pins 2>&1 | grep -v "is ignored" || true
ls .whl
