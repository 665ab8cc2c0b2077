"""A user's own code through the documented paths: their own ``nn.Module`` with the Trainer on the
local target, the job spec's checkpoint settings, and the hyperparameters API.

    pytest tests/integration/test_user_code.py -q
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from dtrain.jobs import api as jobs
from dtrain.spec.model import JobSpec
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

pytestmark = pytest.mark.slow

OWN_MODEL = """
    # A user's own model: two blocks in a ModuleList, none of dtrain's model families.
    import torch
    import torch.nn.functional as F
    from torch import nn
    import dtrain.runtime as rt

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(16, 1)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    def batches(rank):
        generator = torch.Generator().manual_seed(rank)
        while True:
            x = torch.randn(8, 16, generator=generator)
            yield x, x.sum(dim=1, keepdim=True)

    def loss_fn(model, batch):
        x, y = batch
        return F.mse_loss(model(x), y), x.shape[0]

    ctx = rt.init()
    torch.manual_seed(0)
    model = rt.shard(Net(), ctx)
    config = rt.TrainerConfig(steps=5, lr=1e-2, log_interval=1)
    rt.Trainer(model, ctx, loss_fn, config=config).fit(batches(ctx.rank))
    torch.distributed.destroy_process_group()
    """


def test_a_users_own_model_trains_on_the_spec_checkpoint_settings_and_is_saved(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(textwrap.dedent(OWN_MODEL))
    spec = JobSpec.from_dict({
        "name": "own-model", "entry_point": "train.py", "source_dir": str(code),
        "checkpoint": {"interval_steps": 2, "keep_last": 3},
        "compute": {"instance_type": "local", "processes_per_instance": 2, "max_run": 300},
        "distribution": {"sharding_degree": 2, "backend": "gloo"}})
    record = jobs.submit(spec, wait=True)
    assert (record.status, record.failure_reason) == ("Completed", None)
    job_dir = Path(record.target_data["job_dir"])
    # The spec's checkpoint.interval_steps and keep_last drove the Trainer: steps 2, 4 and 5.
    checkpoints = job_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == \
        ["step-000002", "step-000004", "step-000005"]
    # The final model: one safetensors state dict, whole, and the JSON that says what it is.
    model = job_dir / "algo-1" / "model"
    assert sorted(p.name for p in model.iterdir()) == ["dtrain_model.json", "model.safetensors"]
    info = json.loads((model / "dtrain_model.json").read_text())
    assert (info["format"], info["class"], info["parameters"]) == \
        ("dtrain-safetensors/1", "__main__.Net", 2 * (16 * 16 + 16) + 16 + 1)
    saved = load_file(model / "model.safetensors")
    dcp_to_torch_save(checkpoints / "step-000005", tmp_path / "last.pt")
    last = torch.load(tmp_path / "last.pt", weights_only=False)["model"]
    assert saved.keys() == last.keys() == {f"{m}.{p}" for m in ("blocks.0.fc", "blocks.1.fc",
                                                               "head") for p in ("weight", "bias")}
    for key in saved:
        torch.testing.assert_close(saved[key], last[key], rtol=0, atol=0, msg=key)


def test_a_script_gets_the_specs_hyperparameters_as_json_values_and_argv_as_the_toolkit(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(textwrap.dedent("""
        import json, os, sys
        import dtrain.runtime as rt
        out = os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "seen.json")
        with open(out, "w") as f:
            json.dump({"hyperparameters": rt.hyperparameters(), "argv": sys.argv[1:]}, f)
        """))
    hyperparameters = {"opt": {"betas": [0.9, 0.99], "name": "adam"}, "layers": [64, 64],
                       "lr": 0.1, "amp": True, "name": "run 1"}
    spec = JobSpec.from_dict({"name": "hps", "entry_point": "train.py", "source_dir": str(code),
                              "hyperparameters": hyperparameters,
                              "compute": {"instance_type": "local", "max_run": 120}})
    record = jobs.submit(spec, wait=True)
    assert record.status == "Completed", record.failure_reason
    seen = json.loads(Path(record.target_data["job_dir"], "algo-1/output/data/seen.json")
                      .read_text())
    assert seen["hyperparameters"] == hyperparameters
    # The toolkit's argv, kept for scripts written for it: str() of each value, k=v for mappings
    assert seen["argv"] == ["--amp", "True", "--layers", "[64, 64]", "--lr", "0.1",
                            "--name", "run 1", "--opt", "betas=[0.9, 0.99],name=adam"]
