# Sourced by the benchmarks/run_*_h200.sh scripts: the device machine's set-up.
# pyzmq and msgspec are not installed there: the wheels carried in .whl/ go to /tmp/site;
# the project is installed editable (entry points) without touching the device's torch.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed; using src/"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
