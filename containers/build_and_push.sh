#!/usr/bin/env bash
# Build the dtrain runtime image and push it to Amazon ECR.
#
# Usage: containers/build_and_push.sh [OPTIONS]
#
#   --region REGION        ECR region to push to (default: $AWS_REGION, then `aws configure get region`)
#   --account ID           AWS account that owns the repository (default: from `aws sts get-caller-identity`)
#   --repository NAME      ECR repository, created when missing (default: dtrain-runtime)
#   --tag TAG              image tag (default: the version in pyproject.toml)
#   --base-image URI       base image (default: the Dockerfile's AWS PyTorch training image)
#   --base-tag TAG         tag of the default base image, e.g. 2.10.0-gpu-py313-cu130-ubuntu22.04-sagemaker
#   --dlc-account ID       account of the AWS Deep Learning Containers registry (default: 763104351884)
#   --no-flash-attn        do not install flash-attn
#   --platform PLATFORM    docker build platform (default: linux/amd64)
#   --no-push              build and tag only
#   --dry-run              print the commands instead of running them
#   -h, --help             show this help
#
# Prints the pushed image URI last, ready for `sagemaker.image_uri` or `ec2.image_uri` in a job spec.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REGION="${AWS_REGION:-}"
ACCOUNT=""
REPOSITORY="dtrain-runtime"
TAG=""
BASE_IMAGE=""
BASE_TAG=""
DLC_ACCOUNT="763104351884"
FLASH_ATTN=1
PLATFORM="linux/amd64"
PUSH=1
DRY_RUN=0

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

die() { printf 'build_and_push: error: %s\n' "$*" >&2; exit 2; }

# Run a command, or print it (shell-quoted) with --dry-run.
run() {
    if (( DRY_RUN )); then
        printf '+'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}

need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value; see --help"; }

while (( $# > 0 )); do
    case "$1" in
        --region) need_value "$@"; REGION="$2"; shift 2 ;;
        --account) need_value "$@"; ACCOUNT="$2"; shift 2 ;;
        --repository) need_value "$@"; REPOSITORY="$2"; shift 2 ;;
        --tag) need_value "$@"; TAG="$2"; shift 2 ;;
        --base-image) need_value "$@"; BASE_IMAGE="$2"; shift 2 ;;
        --base-tag) need_value "$@"; BASE_TAG="$2"; shift 2 ;;
        --dlc-account) need_value "$@"; DLC_ACCOUNT="$2"; shift 2 ;;
        --no-flash-attn) FLASH_ATTN=0; shift ;;
        --platform) need_value "$@"; PLATFORM="$2"; shift 2 ;;
        --no-push) PUSH=0; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option $1; see --help" ;;
    esac
done

if [[ -z "${TAG}" ]]; then
    TAG="$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "${REPO_ROOT}/pyproject.toml" | head -n 1)"
    [[ -n "${TAG}" ]] || die "no version in pyproject.toml; pass --tag"
fi
[[ "${TAG}" != "latest" ]] || die "--tag latest is ambiguous; tag with a version"
if [[ -z "${REGION}" ]]; then
    REGION="$(aws configure get region 2>/dev/null || true)"
    [[ -n "${REGION}" ]] || die "no AWS region; pass --region or set AWS_REGION"
fi
if [[ -z "${ACCOUNT}" ]]; then
    ACCOUNT="$(aws sts get-caller-identity --query Account --output text)" \
        || die "cannot find the AWS account; configure credentials or pass --account"
fi

REGISTRY="${ACCOUNT}.dkr.ecr.${REGION}.amazonaws.com"
IMAGE="${REGISTRY}/${REPOSITORY}:${TAG}"
VCS_REF="$(git -C "${REPO_ROOT}" rev-parse --short HEAD 2>/dev/null || echo unknown)"

build_args=(
    --build-arg "AWS_REGION=${REGION}"
    --build-arg "DLC_ACCOUNT=${DLC_ACCOUNT}"
    --build-arg "DTRAIN_VERSION=${TAG}"
    --build-arg "VCS_REF=${VCS_REF}"
    --build-arg "BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    --build-arg "INSTALL_FLASH_ATTN=${FLASH_ATTN}"
)
[[ -z "${BASE_IMAGE}" ]] || build_args+=(--build-arg "BASE_IMAGE=${BASE_IMAGE}")
[[ -z "${BASE_TAG}" ]] || build_args+=(--build-arg "BASE_TAG=${BASE_TAG}")

# Pulling the default base needs a login to the AWS DLC registry of this region.
base_registry="${DLC_ACCOUNT}.dkr.ecr.${REGION}.amazonaws.com"
if [[ -z "${BASE_IMAGE}" || "${BASE_IMAGE}" == *.dkr.ecr.*.amazonaws.com/* ]]; then
    [[ -z "${BASE_IMAGE}" ]] || base_registry="${BASE_IMAGE%%/*}"
    if (( DRY_RUN )); then
        printf '+ aws ecr get-login-password --region %q | docker login --username AWS --password-stdin %q\n' \
            "${REGION}" "${base_registry}"
    else
        aws ecr get-login-password --region "${REGION}" \
            | docker login --username AWS --password-stdin "${base_registry}"
    fi
fi

run docker build --platform "${PLATFORM}" -f "${REPO_ROOT}/containers/Dockerfile" \
    "${build_args[@]}" -t "${REPOSITORY}:${TAG}" -t "${IMAGE}" "${REPO_ROOT}"

if (( PUSH )); then
    if (( DRY_RUN )); then
        printf '+ aws ecr describe-repositories --region %q --repository-names %q || aws ecr create-repository ...\n' \
            "${REGION}" "${REPOSITORY}"
        printf '+ aws ecr get-login-password --region %q | docker login --username AWS --password-stdin %q\n' \
            "${REGION}" "${REGISTRY}"
    else
        if ! aws ecr describe-repositories --region "${REGION}" \
                --repository-names "${REPOSITORY}" >/dev/null 2>&1; then
            aws ecr create-repository --region "${REGION}" --repository-name "${REPOSITORY}" \
                --image-scanning-configuration scanOnPush=true >/dev/null
        fi
        aws ecr get-login-password --region "${REGION}" \
            | docker login --username AWS --password-stdin "${REGISTRY}"
    fi
    run docker push "${IMAGE}"
fi

echo "${IMAGE}"
