#!/bin/sh
# dtrain's container entry on SageMaker (AlgorithmSpecification.ContainerEntrypoint).
# Works on a stock AWS PyTorch training image: SageMaker delivers the dtrain_code channel
# (source archive, runtime wheel, this script); we unpack the code where the contract expects it,
# install the runtime wheel offline (so network isolation is fine), then hand over to the agent.
set -eu
# DTRAIN_ROOT moves the whole tree (tests run this script outside a container).
ROOT=${DTRAIN_ROOT:-/opt/ml}
DATA=$ROOT/input/data
CODE_DIR=$ROOT/code
PYTHON=$(command -v python || command -v python3)

mkdir -p "$CODE_DIR"
for archive in "$DATA/dtrain_code/sourcedir.tar.gz" "$DATA"/dtrain_source/*.tar.gz; do
    if [ -f "$archive" ]; then
        tar -xzf "$archive" -C "$CODE_DIR"
    fi
done
for wheel in "$DATA"/dtrain_code/dtrain-*.whl; do
    if [ -f "$wheel" ]; then
        "$PYTHON" -m pip install --no-deps --no-index --force-reinstall --quiet "$wheel"
    fi
done
# As the SageMaker training toolkit does: the job's own requirements come with its code.
if [ -f "$CODE_DIR/requirements.txt" ]; then
    "$PYTHON" -m pip install --quiet -r "$CODE_DIR/requirements.txt"
fi
cd "$CODE_DIR"
exec "$PYTHON" -m dtrain.runtime "$@"
