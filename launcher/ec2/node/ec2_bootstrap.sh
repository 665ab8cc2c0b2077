#!/bin/bash
# dtrain node bootstrap: EC2 user data, run once as root by cloud-init on every node of a job.
# It installs dtrain from the job's wheel and hands over to `python -m dtrain.launcher.ec2.node.bootstrap`
# (rendezvous, container contract, node agent, uploads, status). Whatever happens the node powers
# off at the end, and InstanceInitiatedShutdownBehavior=terminate turns that into termination.
set -uo pipefail
export DTRAIN_NODE_RANK=@@NODE_RANK@@
WHEEL_URI='@@WHEEL_URI@@'
WORK_DIR=${DTRAIN_BOOTSTRAP_DIR:-/opt/dtrain}
mkdir -p "$WORK_DIR"
exec > >(tee -a "$WORK_DIR/bootstrap.log") 2>&1

# Backstop: power off after max_run plus a margin, even if everything below hangs.
shutdown -h +@@SHUTDOWN_AFTER_MIN@@ "dtrain: max_run reached"
trap 'sync; shutdown -h now "dtrain: node finished"' EXIT

imds() {  # IMDSv2 only (the instance requires tokens)
  local token
  token=$(curl -sf --max-time 2 -X PUT http://169.254.169.254/latest/api/token \
    -H "X-aws-ec2-metadata-token-ttl-seconds: 300") || return 1
  curl -sf --max-time 2 -H "X-aws-ec2-metadata-token: $token" \
    "http://169.254.169.254/latest/meta-data/$1"
}
export AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-$(imds placement/region)}

cat > "$WORK_DIR/job.json" <<'DTRAIN_JOB_JSON'
@@JOB_CONFIG@@
DTRAIN_JOB_JSON

# The Deep Learning AMI keeps PyTorch in /opt/pytorch; fall back to the system Python.
PYTHON=${DTRAIN_PYTHON:-}
for candidate in /opt/pytorch/bin/python3 /opt/conda/bin/python3 python3; do
  [ -n "$PYTHON" ] && break
  command -v "$candidate" >/dev/null 2>&1 && PYTHON=$candidate
done

echo "dtrain: node $DTRAIN_NODE_RANK installing $WHEEL_URI with $PYTHON"
aws s3 cp --only-show-errors "$WHEEL_URI" "$WORK_DIR/" || exit 1
"$PYTHON" -m pip install --quiet "$WORK_DIR/${WHEEL_URI##*/}" || exit 1
"$PYTHON" -m dtrain.launcher.ec2.node.bootstrap --config "$WORK_DIR/job.json" \
  --rank "$DTRAIN_NODE_RANK" --work-dir "$WORK_DIR"
