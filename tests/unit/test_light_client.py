"""The client stays light: importing dtrain or running `dtrain --help` loads no torch/SageMaker."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "sagemaker", "transformers", "boto3", "botocore", "numpy")


def modules_after(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    return set(json.loads(out))


def test_import_dtrain_loads_no_heavy_module():
    loaded = modules_after("import dtrain, dtrain.runtime")
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}


def test_cli_help_loads_no_heavy_module():
    code = ("import sys\nfrom dtrain.cli.main import main\nsys.argv=['dtrain','--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass")
    loaded = modules_after(code)
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}
    assert "dtrain.cli.main" in loaded


def test_validate_and_plan_load_no_torch_or_sagemaker(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("entry_point: recipe:causal_lm\nhyperparameters: {model: pythia-70m}\n")
    code = ("import sys\nfrom dtrain.cli.main import main\n"
            f"for args in (['validate', {str(spec)!r}], ['plan', {str(spec)!r}]):\n"
            "    try:\n        main(args)\n    except SystemExit:\n        pass")
    loaded = modules_after(code)
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "sagemaker")}


def test_dunder_all_lists_every_lazy_public_name_and_each_resolves():
    import dtrain

    assert sorted(dtrain.__all__) == sorted(["__version__", *dtrain._LAZY])
    for name in dtrain.__all__:
        assert getattr(dtrain, name) is not None, name
