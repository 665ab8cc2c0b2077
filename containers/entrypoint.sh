#!/usr/bin/env bash
# Entry script of the dtrain runtime image (the SageMaker training-container contract).
#
#   dtrain-entrypoint train [AGENT ARGS...]   unpack the job's code, run the node agent
#   dtrain-entrypoint COMMAND [ARGS...]       run COMMAND as given (bash, python, ...)
#
# SageMaker starts training containers as `docker run IMAGE train`; dtrain's EC2 bootstrap runs
# `IMAGE bash -c ...` (passed through). `train` becomes `python -m dtrain.runtime --root $DTRAIN_ROOT`, after the code is put
# in $DTRAIN_ROOT/code from the first of:
#   1. $DTRAIN_CODE_TARBALL          a local .tar.gz, or an s3:// URI
#   2. an input channel `dtrain_code`, `dtrain_source` or `code` (what dtrain's SageMaker launcher
#      and SageMaker's ModelTrainer send): sourcedir.tar.gz (or the one .tar.gz) is unpacked,
#      a channel of plain files is copied
#   3. the `sagemaker_submit_directory` hyperparameter (SageMaker SDK script mode): s3:// or local
# Nothing found means the code is already there (baked into the image, or a recipe). A
# requirements.txt in the code is installed first, as the SageMaker training toolkit does.
#
# Environment: DTRAIN_ROOT (default /opt/ml), DTRAIN_PYTHON (default python3).
set -euo pipefail

ROOT="${DTRAIN_ROOT:-/opt/ml}"
PYTHON="${DTRAIN_PYTHON:-python3}"
CODE_DIR="${ROOT}/code"
DATA_DIR="${ROOT}/input/data"
CODE_CHANNELS=(dtrain_code dtrain_source code)
HYPERPARAMETERS_FILE="${ROOT}/input/config/hyperparameters.json"

log() { printf 'dtrain-entrypoint: %s\n' "$*" >&2; }

die() {
    log "error: $*"
    # SageMaker shows output/failure as the job's FailureReason.
    if mkdir -p "${ROOT}/output" 2>/dev/null; then
        printf 'dtrain-entrypoint: %s\n' "$*" > "${ROOT}/output/failure" || true
    fi
    exit 2
}

usage() {
    # The comment block at the top of this file, without the '#'.
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}

# The hyperparameter's value, JSON-decoded as the SageMaker SDK encodes it; empty when absent.
submit_directory_hyperparameter() {
    [[ -f "${HYPERPARAMETERS_FILE}" ]] || return 0
    "${PYTHON}" - "${HYPERPARAMETERS_FILE}" <<'PY'
import json, sys
with open(sys.argv[1]) as f:
    value = json.load(f).get("sagemaker_submit_directory", "")
try:
    value = json.loads(value)
except (TypeError, ValueError):
    pass
print(value if isinstance(value, str) else "")
PY
}

# Copy an s3:// object to a local file with boto3 (a dependency of dtrain, so always present).
download_s3() {
    "${PYTHON}" - "$1" "$2" <<'PY'
import sys
import boto3
bucket, _, key = sys.argv[1][len("s3://"):].partition("/")
boto3.client("s3").download_file(bucket, key, sys.argv[2])
PY
}

unpack_tarball() {
    local source="$1" tarball downloaded=""
    case "${source}" in
        s3://*)
            tarball="$(mktemp "${TMPDIR:-/tmp}/dtrain-code.XXXXXX")"
            downloaded="${tarball}"
            log "downloading ${source}"
            download_s3 "${source}" "${tarball}" \
                || die "could not download ${source}; check the URI and the role's s3:GetObject permission"
            ;;
        file://*) tarball="${source#file://}" ;;
        *) tarball="${source}" ;;
    esac
    [[ -f "${tarball}" ]] \
        || die "code archive ${source} not found; point DTRAIN_CODE_TARBALL or sagemaker_submit_directory at a .tar.gz"
    mkdir -p "${CODE_DIR}"
    log "unpacking ${source} into ${CODE_DIR}"
    # GNU tar refuses absolute and '..' member names; --no-same-owner keeps the files ours.
    tar -xzf "${tarball}" -C "${CODE_DIR}" --no-same-owner \
        || die "could not unpack ${source}; it must be a gzip-compressed tar archive"
    [[ -z "${downloaded}" ]] || rm -f "${downloaded}"
}

# Unpack or copy one code channel; returns 1 when the channel is absent.
code_from_channel() {
    local channel="$1" archives
    [[ -d "${channel}" ]] || return 1
    shopt -s nullglob
    archives=("${channel}"/*.tar.gz)
    shopt -u nullglob
    if [[ -f "${channel}/sourcedir.tar.gz" ]]; then
        unpack_tarball "${channel}/sourcedir.tar.gz"
    elif (( ${#archives[@]} == 1 )); then
        unpack_tarball "${archives[0]}"
    elif (( ${#archives[@]} > 1 )); then
        die "code channel ${channel} holds ${#archives[@]} archives; ship one sourcedir.tar.gz"
    else
        mkdir -p "${CODE_DIR}"
        log "copying ${channel} into ${CODE_DIR}"
        cp -a "${channel}/." "${CODE_DIR}/"
    fi
}

prepare_code() {
    local channel submit_dir
    if [[ -n "${DTRAIN_CODE_TARBALL:-}" ]]; then
        unpack_tarball "${DTRAIN_CODE_TARBALL}"
        return
    fi
    for channel in "${CODE_CHANNELS[@]}"; do
        code_from_channel "${DATA_DIR}/${channel}" && return
    done
    submit_dir="$(submit_directory_hyperparameter)" || die "cannot read ${HYPERPARAMETERS_FILE}"
    [[ -z "${submit_dir}" ]] || unpack_tarball "${submit_dir}"
}

install_requirements() {
    [[ -f "${CODE_DIR}/requirements.txt" ]] || return 0
    log "installing ${CODE_DIR}/requirements.txt"
    "${PYTHON}" -m pip install --no-cache-dir --quiet -r "${CODE_DIR}/requirements.txt" \
        || die "pip could not install ${CODE_DIR}/requirements.txt"
}

main() {
    local command="${1:-train}"
    case "${command}" in
        train)
            if (( $# > 0 )); then shift; fi
            prepare_code
            install_requirements
            export DTRAIN_ROOT="${ROOT}"
            exec "${PYTHON}" -m dtrain.runtime --root "${ROOT}" "$@"
            ;;
        serve)
            die "this is a training image; SageMaker hosting (serve) is not supported"
            ;;
        -h|--help|help)
            usage
            ;;
        *)
            exec "$@"
            ;;
    esac
}

main "$@"
