#!/usr/bin/env bash
# Run every test suite with the CURRENT interpreter: no venv, no network.
# For a machine that already has torch and triton (the GPU machine):
#     bash tools/run_here.sh            # all packages + integration
#     bash tools/run_here.sh -k softmax # extra pytest arguments pass through
# On a machine without CUDA, Triton kernels run under the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/packages/stoker-shapes/src:$PWD/packages/stoker-capture/src:$PWD/packages/stoker-autograd/src:$PWD/packages/stoker-triton/src:$PWD/packages/stoker/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=1
fi
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
status=0
for dir in packages/stoker-shapes/tests packages/stoker-capture/tests packages/stoker-autograd/tests \
           packages/stoker-triton/tests packages/stoker/tests tests-integration; do
    [ -d "$dir" ] || continue
    echo "=== $dir"
    "$PY" -m pytest "$dir" -q -p no:cacheprovider "$@" || status=1
done
exit $status
