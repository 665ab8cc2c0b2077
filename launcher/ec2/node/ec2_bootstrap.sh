#!/bin/bash
# dtrain node bootstrap: EC2 user data, run once as root by cloud-init on every node of a job.
# It installs dtrain from the job's wheel and hands over to `python -m dtrain.launcher.ec2.node.bootstrap`
# (rendezvous, container contract, node agent, uploads, status). Whatever happens the node powers
# off at the end, and InstanceInitiatedShutdownBehavior=terminate turns that into termination.
set -uo pipefail
WHEEL_URI='@@WHEEL_URI@@'
# Where the Python half reports; {host} is this node's private IP.
STATUS_URI='@@STATUS_URI@@'
LOG_URI='@@LOG_URI@@'
LAUNCH_TOKEN='@@LAUNCH_TOKEN@@'
WORK_DIR=${DTRAIN_BOOTSTRAP_DIR:-/opt/dtrain}
mkdir -p "$WORK_DIR"
exec > >(tee -a "$WORK_DIR/@@BOOTSTRAP_LOG@@") 2>&1

# Backstop: power off after max_run plus a margin, even if everything below hangs.
shutdown -h +@@SHUTDOWN_AFTER_MIN@@ "dtrain: max_run reached"
trap 'sync; shutdown -h now "dtrain: node finished"' EXIT

# IMDSv2 only (the instance requires tokens); the AWS SDKs' variable moves it. Asked up to five
# times, 2 s apart: one slow answer at boot must not cost the node, and so the cluster.
imds() {
  local token attempt endpoint=${AWS_EC2_METADATA_SERVICE_ENDPOINT:-http://169.254.169.254}
  for attempt in 1 2 3 4 5; do
    token=$(curl -sf --max-time 2 -X PUT "$endpoint/latest/api/token" \
      -H "X-aws-ec2-metadata-token-ttl-seconds: 300") \
      && curl -sf --max-time 2 -H "X-aws-ec2-metadata-token: $token" \
        "$endpoint/latest/meta-data/$1" && return 0
    [ "$attempt" -lt 5 ] && sleep 2
  done
  return 1
}
export AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-$(imds placement/region)}

# The Python half reports every end itself. Before it runs (the wheel, pip) or if it dies
# without a report, this half writes the failed status object in its place, so `dtrain status`
# says why and the other nodes stop waiting for this one, then uploads the node's log.
fail() {
  local host instance reason
  host=$(imds local-ipv4) || host=$(hostname -I | cut -d' ' -f1)
  instance=$(imds instance-id) || instance=unknown
  reason="bootstrap failed on $host: $1"
  echo "dtrain: $reason"
  printf '{"exit_code": 1, "host": "%s", "instance_id": "%s", "launch": "%s", "rank": %s, "reason": "%s", "state": "failed", "updated": %s}\n' \
    "$host" "$instance" "$LAUNCH_TOKEN" "${DTRAIN_NODE_RANK:-null}" "$reason" "$(date +%s)" \
    | aws s3 cp --only-show-errors - "${STATUS_URI//\{host\}/$host}"
  aws s3 cp --only-show-errors "$WORK_DIR/@@BOOTSTRAP_LOG@@" "${LOG_URI//\{host\}/$host}"
  exit 1
}

# Every node runs this same script: its rank is its launch index in the job's one RunInstances
# request (0 to N-1).
DTRAIN_NODE_RANK=$(imds ami-launch-index) || DTRAIN_NODE_RANK=
if ! [[ $DTRAIN_NODE_RANK =~ ^[0-9]+$ ]]; then
  DTRAIN_NODE_RANK=
  fail "could not read this node's launch index (ami-launch-index) from the instance metadata"
fi
export DTRAIN_NODE_RANK

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
aws s3 cp --only-show-errors "$WHEEL_URI" "$WORK_DIR/" \
  || fail "could not download dtrain's wheel $WHEEL_URI"
"$PYTHON" -m pip install --quiet "$WORK_DIR/${WHEEL_URI##*/}" \
  || fail "$PYTHON -m pip could not install ${WHEEL_URI##*/}"
rm -f "$WORK_DIR/@@REPORTED@@"
"$PYTHON" -m dtrain.launcher.ec2.node.bootstrap --config "$WORK_DIR/job.json" \
  --rank "$DTRAIN_NODE_RANK" --work-dir "$WORK_DIR"
code=$?
[ -f "$WORK_DIR/@@REPORTED@@" ] \
  || fail "python -m dtrain.launcher.ec2.node.bootstrap exited with code $code before reporting"
exit "$code"
