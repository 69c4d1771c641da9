# Sourced by the device scripts, from the repository root: sets PY, RES
# (emptied), PYTHONUNBUFFERED and PYTHONPATH, installing the wheels in .whl
# (what the machine's image lacks; see session.sh) unless NO_WHEELS is set.
# Before sourcing, the caller may set PY and must set RES_DEFAULT.
PY=${PY:-python3}
RES=${RES:-$RES_DEFAULT}
rm -rf "$RES"; mkdir -p "$RES"
export PYTHONUNBUFFERED=1
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
