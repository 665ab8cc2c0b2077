#!/usr/bin/env bash
# Entry script of the dtrain runtime image (the SageMaker training-container contract).
#
#   dtrain-entrypoint train [AGENT ARGS...]   unpack the job's code, run the node agent
#   dtrain-entrypoint COMMAND [ARGS...]       run COMMAND as given (bash, python, ...)
#
# SageMaker starts training containers as `docker run IMAGE train`; the dtrain EC2 launcher does
# the same. `train` becomes `python -m dtrain.runtime --root $DTRAIN_ROOT`, after the code is put
# in $DTRAIN_ROOT/code from the first of:
#   1. $DTRAIN_CODE_TARBALL          a local .tar.gz, or an s3:// URI
#   2. the `sagemaker_submit_directory` hyperparameter (SageMaker SDK script mode): s3:// or local
#   3. the `code` input channel: sourcedir.tar.gz (or any one .tar.gz) is unpacked, other files
#      are copied
# Nothing found means the code is already there (baked into the image or a recipe).
#
# Environment: DTRAIN_ROOT (default /opt/ml), DTRAIN_PYTHON (default python3).
set -euo pipefail

ROOT="${DTRAIN_ROOT:-/opt/ml}"
PYTHON="${DTRAIN_PYTHON:-python3}"
CODE_DIR="${ROOT}/code"
CODE_CHANNEL_DIR="${ROOT}/input/data/code"
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
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
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

prepare_code() {
    local submit_dir archives
    if [[ -n "${DTRAIN_CODE_TARBALL:-}" ]]; then
        unpack_tarball "${DTRAIN_CODE_TARBALL}"
        return
    fi
    submit_dir="$(submit_directory_hyperparameter)" || die "cannot read ${HYPERPARAMETERS_FILE}"
    if [[ -n "${submit_dir}" ]]; then
        unpack_tarball "${submit_dir}"
        return
    fi
    [[ -d "${CODE_CHANNEL_DIR}" ]] || return 0
    shopt -s nullglob
    archives=("${CODE_CHANNEL_DIR}"/*.tar.gz)
    shopt -u nullglob
    if [[ -f "${CODE_CHANNEL_DIR}/sourcedir.tar.gz" ]]; then
        unpack_tarball "${CODE_CHANNEL_DIR}/sourcedir.tar.gz"
    elif (( ${#archives[@]} == 1 )); then
        unpack_tarball "${archives[0]}"
    elif (( ${#archives[@]} > 1 )); then
        die "code channel holds ${#archives[@]} archives; ship one sourcedir.tar.gz"
    else
        mkdir -p "${CODE_DIR}"
        log "copying the code channel into ${CODE_DIR}"
        cp -a "${CODE_CHANNEL_DIR}/." "${CODE_DIR}/"
    fi
}

main() {
    local command="${1:-train}"
    case "${command}" in
        train)
            if (( $# > 0 )); then shift; fi
            prepare_code
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
