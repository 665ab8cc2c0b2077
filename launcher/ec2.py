"""The EC2 backend: a cluster placement group of EFA nodes that bootstrap themselves from S3.

``build_request(plan)`` is pure (``ec2_requests``); ``submit`` shows the cost, asks above
``ec2.confirm_above_usd`` (unless told yes), uploads the code and a dtrain wheel to
``{output_path}/{job}/source/``, resolves the lookups (DLAMI id from SSM, subnet, VPC), creates
the placement and security groups and launches one node at a time. Any failure after the first
resource exists — ``InsufficientInstanceCapacity`` on node 2, Ctrl-C, anything — terminates
every node launched and deletes what was created, then raises one line saying what to try.

``status``/``logs``/``stop`` work from the job name: instances carry the job's tags (its S3
prefix included), nodes write ``{prefix}/status/<host>.json`` and their logs under
``{prefix}/logs/<host>/``. ``stop`` terminates every node and deletes the groups dtrain created.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import IO, TYPE_CHECKING, Any

from dtrain.errors import DtrainError
from dtrain.launcher import aws
from dtrain.launcher import ec2_requests as req
from dtrain.launcher import ec2_resources as res

if TYPE_CHECKING:
    from dtrain.planner import Plan

TERMINAL_STATES = ("Completed", "Failed", "Stopped")
CAPACITY_CODES = ("InsufficientInstanceCapacity", "InsufficientCapacityOnHost",
                  "InsufficientReservedInstanceCapacity", "SpotMaxPriceTooLow",
                  "InsufficientCapacity", "ReservationCapacityExceeded")
QUOTA_CODES = ("VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded")


def needs_confirmation(request: dict[str, Any]) -> bool:
    """True when the job's max_run cost is above ``ec2.confirm_above_usd`` (or unknown)."""
    cost = request["cost"]
    return cost["max_run_cost"] is None or cost["max_run_cost"] > cost["confirm_above_usd"]


class Ec2Launcher(aws.AwsBackend):
    """``build_request`` / ``submit`` / ``status`` / ``logs`` / ``stop`` for ``target: ec2``.

    ``assume_yes`` / ``confirm`` are the CLI's hook for the cost check: ``confirm(question)``
    returns True to go ahead; with neither, a job above the threshold is refused.
    """

    name = "ec2"

    def __init__(self, *, ec2_client: Any = None, s3_client: Any = None, ssm_client: Any = None,
                 region: str | None = None, stream: IO[str] | None = None,
                 assume_yes: bool = False, confirm: Callable[[str], bool] | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 sleep: Callable[[float], None] = time.sleep):
        super().__init__({"ec2": ec2_client, "s3": s3_client, "ssm": ssm_client},
                         region=region, stream=stream, clock=clock, sleep=sleep)
        self.assume_yes = assume_yes
        self.confirm = confirm

    # ---------------------------------------------------------------- request

    def build_request(self, plan: Plan, *, job_name: str | None = None) -> dict[str, Any]:
        """Every EC2 call of the job, with ``{{placeholders}}`` for the lookups (no AWS call)."""
        from dtrain.launcher.sagemaker_request import training_job_name

        name = job_name or training_job_name(plan.spec.name, now=self.clock())
        self.region = self.region or plan.spec.ec2.region
        self._plans[name] = plan
        return req.build_request(plan, job_name=name)

    # ---------------------------------------------------------------- submit

    def check_cost(self, request: dict[str, Any]) -> None:
        """Print the cost line; above the threshold go on only when told yes."""
        line = req.cost_line(request["cost"])
        self.out.write(line + "\n")
        if not needs_confirmation(request) or self.assume_yes:
            return
        limit = request["cost"]["confirm_above_usd"]
        if self.confirm is not None and self.confirm(f"{line}; above ${limit:,.2f}. Launch?"):
            return
        raise DtrainError(f"not launched: {line} is above ec2.confirm_above_usd=${limit:,.2f}; "
                          "pass --yes, raise ec2.confirm_above_usd, or lower compute.max_run")

    def submit(self, request: dict[str, Any], *, store: Any = None,
               plan: Plan | None = None) -> dict[str, Any]:
        """Launch the cluster; on any failure leave nothing behind. Returns the job's facts."""
        job = request["job"]
        plan = plan or self._plans.get(job)
        self.check_cost(request)
        values = {"launch_token": uuid.uuid4().hex[:16]}
        created = res.Created(job=job)
        try:
            values.update(self._lookups(request))
            self._upload_code(plan, request, created)
            facts = self._launch(req.fill_placeholders(request, values), values, created)
        except BaseException as exc:  # noqa: BLE001 - Ctrl-C mid-launch must not leak nodes
            cleanup = res.rollback(self.client("ec2"), self.client("s3"), created,
                                   sleep=self.sleep)
            raise self._launch_error(exc, request, created, cleanup) from None
        if store is not None:
            store.add(job_name=job, target=self.name,
                      spec=plan.spec.to_dict() if plan else None, request=request,
                      details=facts)
        return facts

    def _lookups(self, request: dict[str, Any]) -> dict[str, str]:
        lookups = request["lookups"]
        ec2 = self.client("ec2")
        values = {"ami_id": res.resolve_ami(self.client("ssm"), lookups["ami_id"])}
        values["root_device"] = res.resolve_root_device(ec2, lookups["root_device"],
                                                        values["ami_id"])
        values["subnet_id"], values["vpc_id"] = res.resolve_subnet(ec2, lookups["subnet_id"])
        return values

    def _upload_code(self, plan: Plan | None, request: dict[str, Any],
                     created: res.Created) -> None:
        from pathlib import Path

        from dtrain.launcher import packaging

        s3 = self.client("s3")
        prefix = f"{request['prefix']}/source"
        with tempfile.TemporaryDirectory(prefix="dtrain-ec2-") as tmp:
            files = [packaging.build_runtime_wheel(tmp)]
            source = plan.spec.source_dir if plan else None
            if source and not plan.spec.is_recipe and not source.startswith("s3://"):
                packed = packaging.pack_source(source, tmp)
                for secret in packed.skipped_secrets:
                    self.out.write(f"warning: not packing {secret} (looks like a secret)\n")
                files.insert(0, packed.path)
            for path in files:
                uri = f"{prefix}/{Path(path).name}"
                created.uploads.append(uri)
                packaging.upload_file(s3, path, uri, stream=self.out)

    def _launch(self, request: dict[str, Any], values: dict[str, str],
                created: res.Created) -> dict[str, Any]:
        ec2 = self.client("ec2")
        group = request["placement_group"]
        if group["create"]:
            ec2.create_placement_group(**group["CreatePlacementGroup"])
            created.placement_groups.append(group["GroupName"])
        sg = request["security_group"]
        group_id = ec2.create_security_group(**sg["CreateSecurityGroup"])["GroupId"]
        created.security_groups.append(group_id)
        rules = req.fill_placeholders(sg, {"security_group_id": group_id})
        ec2.authorize_security_group_ingress(**rules["AuthorizeSecurityGroupIngress"])
        ec2.authorize_security_group_egress(**rules["AuthorizeSecurityGroupEgress"])
        for rank, node in enumerate(request["run_instances"]):
            node = req.fill_placeholders(node, {"security_group_id": group_id})
            self.out.write(f"launching node {rank + 1}/{len(request['run_instances'])} "
                           f"({node['InstanceType']})\n")
            instance = ec2.run_instances(**node)["Instances"][0]
            created.instances.append(instance["InstanceId"])
        return {"job_name": created.job, "target": self.name, "region": self.region,
                "prefix": request["prefix"], "launch_token": values["launch_token"],
                "instance_ids": list(created.instances), "subnet_id": values["subnet_id"],
                "security_group_id": group_id, "placement_group": group["GroupName"],
                "created_placement_group": group["create"],
                "uploads": list(created.uploads)}

    def _launch_error(self, exc: BaseException, request: dict[str, Any], created: res.Created,
                      cleanup: list[str]) -> BaseException:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        nodes = len(request["run_instances"])
        done = (f"launched {len(created.instances)} of {nodes} nodes, all terminated"
                if created.instances else "no node was launched")
        left = ("" if not cleanup else
                f"; could not remove {', '.join(cleanup)}: run `dtrain ec2 gc`")
        code = aws.error_code(exc)
        itype = request["run_instances"][0]["InstanceType"]
        if code in CAPACITY_CODES:
            return DtrainError(
                f"EC2 has no capacity for {nodes} × {itype} ({code}; {done}){left}; try another "
                "AZ (ec2.subnet_id), a capacity reservation (ec2.capacity_reservation_id), or "
                "fewer nodes (compute.instance_count)")
        if code in QUOTA_CODES:
            return DtrainError(
                f"EC2 quota reached for {nodes} × {itype} ({code}; {done}){left}; raise the "
                "'Running On-Demand P instances' (or spot) vCPU quota in Service Quotas")
        if isinstance(exc, DtrainError):
            return DtrainError(f"{exc} ({done}){left}")
        if code is None:
            return DtrainError(f"EC2 launch failed: {type(exc).__name__}: {exc} ({done}){left}")
        error = aws.as_dtrain_error(exc, "EC2 launch")
        return DtrainError(f"{error} ({done}){left}")

    # ---------------------------------------------------------------- lifecycle

    def describe(self, job_name: str, *, details: dict | None = None) -> dict[str, Any]:
        """The job's instances (found by tag) and facts from the store, merged."""
        instances = res.job_instances(self.client("ec2"), job_name)
        facts = dict(details or {})
        if instances:
            tags = res.tag_map(instances[0])
            facts.setdefault("prefix", tags.get(req.TAG_PREFIX))
            facts.setdefault("num_nodes", int(tags.get(req.TAG_NUM_NODES, len(instances))))
        if not facts.get("prefix"):
            raise DtrainError(f"job {job_name!r}: no EC2 instance or job record found; check "
                              "the name with `dtrain list`")
        facts.setdefault("num_nodes", len(facts.get("instance_ids") or instances) or 1)
        facts["instances"] = instances
        return facts

    def status(self, job_name: str, *, details: dict | None = None) -> dict[str, Any]:
        """Job state from instance states plus each node's S3 status object."""
        facts = self.describe(job_name, details=details)
        nodes = res.read_status_objects(self.client("s3"), facts["prefix"])
        states = {i["InstanceId"]: i["State"]["Name"] for i in facts["instances"]}
        return {"job_name": job_name, "target": self.name,
                **res.job_state(states, nodes, facts["num_nodes"]),
                "instances": states, "nodes": nodes,
                "model_data": f"{facts['prefix']}/model/"}

    def logs(self, job_name: str, *, follow: bool = False, host: str | None = None,
             rank: int | None = None, poll_s: float = 10.0,
             details: dict | None = None) -> Iterator[str]:
        """``host: line`` from each node's logs in S3 (uploaded every 30 s while it runs)."""
        facts = self.describe(job_name, details=details)
        seen: dict[str, int] = {}
        while True:
            yield from res.new_log_lines(self.client("s3"), facts["prefix"], seen,
                                         host=host, rank=rank)
            if not follow or self.status(job_name, details=details)["state"] in TERMINAL_STATES:
                yield from res.new_log_lines(self.client("s3"), facts["prefix"], seen,
                                             host=host, rank=rank)
                return
            self.sleep(poll_s)

    def stop(self, job_name: str, *, details: dict | None = None) -> list[str]:
        """Terminate every node of the job, then delete the groups dtrain created for it."""
        ec2 = self.client("ec2")
        created = res.Created(job=job_name)
        created.instances = [i["InstanceId"] for i in res.job_instances(ec2, job_name)
                             if i["State"]["Name"] not in ("terminated",)]
        created.security_groups = [g["GroupId"] for g in res.job_security_groups(ec2, job_name)]
        created.placement_groups = [g["GroupName"] for g in res.job_placement_groups(ec2, job_name)]
        left = res.rollback(ec2, None, created, sleep=self.sleep, keep_uploads=True)
        self.out.write(f"stopped {job_name}: terminated {len(created.instances)} node(s)"
                       + (f"; could not remove {', '.join(left)}: run `dtrain ec2 gc`" if left
                          else "") + "\n")
        return left


def dumps(request: dict[str, Any]) -> str:
    """The request set as ``--dry-run`` prints it."""
    return json.dumps(request, indent=2)
