"""Metrics: the FLOP formula the planner uses, MFU against the catalog, the metric line sinks;
and the optimizer pieces they report on (schedule, clipping, loss scaler)."""

from __future__ import annotations

import copy
import io
import json
import math

import pytest
import torch
from dtrain.core import instances
from dtrain.core.metrics_format import parse_metrics
from dtrain.runtime.models import from_preset
from dtrain.runtime.train import metrics as m
from dtrain.runtime.train.optim import DynamicLossScaler, build_optimizer, clip_and_unscale_
from dtrain.runtime.train.schedule import WarmupCosine
from torch import nn


@pytest.mark.parametrize("checkpointing, factor", [(False, 1.0), (True, 4 / 3)])
def test_model_flops_per_token_counts_weights_and_attention(checkpointing, factor):
    # GPT-NeoX tiny: h=64, L=2, vocab 512, untied head; 6·N + 12·L·h·s per token
    model = from_preset("gpt-neox-tiny")
    n = sum(p.numel() for p in model.parameters())
    expected = (6 * n + 12 * 2 * 64 * 128) * factor
    assert m.model_flops_per_token(model, seq_len=128,
                                   activation_checkpointing=checkpointing) == pytest.approx(expected)


def test_mfu_uses_the_instance_catalog_peak_or_the_nominal_cpu_figure(monkeypatch):
    monkeypatch.delenv(m.PEAK_TFLOPS_ENV, raising=False)
    assert m.peak_tflops("ml.p4d.24xlarge", device=torch.device("cpu")) == (312, False)
    assert m.peak_tflops("local", device=torch.device("cpu")) == (instances.LOCAL_CPU_TFLOPS, True)
    out = m.throughput_metrics(tokens=1000, seconds=2.0, flops_per_token=1e9, world_size=4,
                               peak_tflops=0.1)
    assert out["tokens_per_s"] == 500
    assert out["tflops_per_gpu"] == pytest.approx(500 * 1e9 / 4 / 1e12)
    assert out["mfu"] == pytest.approx(out["tflops_per_gpu"] / 0.1)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA A100-SXM4-40GB", 312), ("NVIDIA A10G", 70),
    ("NVIDIA L40S", 362), ("Tesla V100-SXM2-16GB", 125), ("NVIDIA GeForce RTX 4090", 0.0),
])
def test_gpu_peak_is_read_from_the_catalog_by_model_name(name, peak):
    assert instances.gpu_peak_tflops(name) == peak


def test_a_local_gpu_gets_its_models_peak_not_the_cpu_figure(monkeypatch):
    # local_gpu has no figure in the catalog; the device's name decides (no GPU here: the name
    # lookup is the only CUDA call, so it is replaced).
    monkeypatch.delenv(m.PEAK_TFLOPS_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert m.peak_tflops("local_gpu", device=torch.device("cuda", 0)) == (989, False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    with pytest.warns(UserWarning, match="DTRAIN_PEAK_TFLOPS"):
        assert m.peak_tflops("local_gpu", device=torch.device("cuda", 0)) == (
            instances.LOCAL_CPU_TFLOPS, True)


def test_peak_override_wins_and_is_checked(monkeypatch):
    monkeypatch.setenv(m.PEAK_TFLOPS_ENV, "500")
    assert m.peak_tflops("ml.p4d.24xlarge", device=torch.device("cpu")) == (500.0, False)
    monkeypatch.setenv(m.PEAK_TFLOPS_ENV, "fast")
    with pytest.raises(ValueError, match="DTRAIN_PEAK_TFLOPS='fast'"):
        m.peak_tflops("local", device=torch.device("cpu"))


def test_logger_writes_parseable_lines_and_jsonl(tmp_path):
    stream = io.StringIO()
    logger = m.MetricsLogger(output_dir=tmp_path, stream=stream)
    logger.log(12, {"loss": 2.5, "tokens_per_s": 1234.5, "mfu": 0.25})
    logger.close()
    parsed = parse_metrics(stream.getvalue().strip())
    assert parsed == {"step": 12, "loss": 2.5, "tokens_per_s": 1234.5, "mfu": 0.25}
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record == {"step": 12, "loss": 2.5, "tokens_per_s": 1234.5, "mfu": 0.25}


def test_logger_writes_tensorboard_scalars_that_tensorboard_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = m.MetricsLogger(output_dir=tmp_path, stream=io.StringIO())
    logger.log(10, {"loss": 2.5, "mfu": 0.25})
    logger.log(20, {"loss": 2.0, "mfu": 0.5})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert sorted(events.Tags()["scalars"]) == ["train/loss", "train/mfu"]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(10, 2.5), (20, 2.0)]
    assert [(e.step, e.value) for e in events.Scalars("train/mfu")] == [(10, 0.25), (20, 0.5)]


def test_only_the_main_rank_writes(tmp_path):
    stream = io.StringIO()
    m.MetricsLogger(output_dir=tmp_path, enabled=False, stream=stream).log(1, {"loss": 1.0})
    assert stream.getvalue() == "" and not (tmp_path / "metrics.jsonl").exists()


def test_comm_metrics_are_per_step_with_tensor_and_pipeline_bytes_on_their_own():
    snap = {"total": {"calls": 8, "intra_bytes": 400.0, "inter_bytes": 100.0},
            "tensor_parallel": {"calls": 4, "intra_bytes": 240.0, "inter_bytes": 0.0},
            "pipeline": {"calls": 2, "intra_bytes": 0.0, "inter_bytes": 80.0}}
    assert m.comm_metrics(snap, steps=4) == {"comm_intra_bytes_per_step": 100.0,
                                             "comm_inter_bytes_per_step": 25.0,
                                             "comm_calls_per_step": 2.0,
                                             "comm_tp_bytes_per_step": 60.0,
                                             "comm_pp_bytes_per_step": 20.0}


def test_tensor_parallel_ranks_share_one_replica_s_tokens_and_flops_are_counted_once():
    # 8 devices as 2 data-parallel replicas of tp 4: 1000 tokens in 2 s, each token once
    out = m.throughput_metrics(tokens=1000, seconds=2.0, flops_per_token=1e9, world_size=8,
                               peak_tflops=0.1, replicas=2)
    assert (out["tokens_per_s"], out["tokens_per_s_per_replica"]) == (500, 250)
    assert out["tflops_per_gpu"] == pytest.approx(500 * 1e9 / 8 / 1e12)


def test_warmup_then_cosine_to_the_floor():
    s = WarmupCosine(1.0, 112, warmup_steps=10, min_lr_ratio=0.1)
    assert s.lr_at(0) == pytest.approx(0.1) and s.lr_at(9) == pytest.approx(1.0)
    assert s.lr_at(10) < 1.0  # the peak once, not twice
    assert s.lr_at(60) == pytest.approx(0.55)  # half way from step 9 to step 111
    # the last update (step 111 of 112) is the one at the floor, not one never trained
    assert s.lr_at(111) == pytest.approx(0.1) and s.lr_at(110) > 0.1
    assert s.lr_at(500) == pytest.approx(0.1)
    flat = WarmupCosine(1.0, 5, min_lr_ratio=0.0)  # no warm-up: the peak first, 0 last
    assert [round(flat.lr_at(i), 3) for i in range(5)] == [1.0, 0.854, 0.5, 0.146, 0.0]
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupCosine(1.0, 5, warmup_steps=6)


def test_an_optimizer_of_ones_own_keeps_its_groups_learning_rates_as_peaks():
    # the Trainer's own optimizer follows config.lr; a user's keeps its per-group rates, shaped
    params = [nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))]
    sgd = torch.optim.SGD([{"params": params[:1], "lr": 0.5}, {"params": params[1:], "lr": 0.05}])
    schedule = WarmupCosine(3e-4, 5, min_lr_ratio=0.0)
    assert schedule.apply(sgd, 2, peaks=[0.5, 0.05]) == pytest.approx(0.25)
    assert [g["lr"] for g in sgd.param_groups] == pytest.approx([0.25, 0.025])
    assert schedule.apply(sgd, 2) == pytest.approx(1.5e-4)  # no peaks: lr for every group
    assert [g["lr"] for g in sgd.param_groups] == pytest.approx([1.5e-4, 1.5e-4])


def test_adamw_does_not_decay_biases_and_norms():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    groups = build_optimizer(model, lr=1e-3, weight_decay=0.1).param_groups
    assert [len(g["params"]) for g in groups] == [1, 3]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


def test_adamw_is_the_fused_kernel_and_steps_as_the_reference_loop_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    reference = copy.deepcopy(model)
    ours = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    assert all(g["fused"] for g in ours.param_groups)  # 4-6x the loop/foreach on CPU
    theirs = torch.optim.AdamW([{"params": [reference[0].weight], "weight_decay": 0.1},
                                {"params": [reference[0].bias, *reference[1].parameters()],
                                 "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95),
                               foreach=False)
    for _ in range(3):
        x = torch.randn(4, 8)
        for net, opt in ((model, ours), (reference, theirs)):
            net(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_clipping_unscales_and_caps_the_norm():
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([30.0, 40.0]) * 8  # true norm 50, loss scale 8
    norm, scaled = clip_and_unscale_([p], max_norm=5.0, loss_scale=8.0)
    assert norm == pytest.approx(50.0) and scaled == pytest.approx(400.0)
    assert torch.linalg.vector_norm(p.grad).item() == pytest.approx(5.0, rel=1e-5)


def test_loss_scaler_skips_overflowing_steps_and_grows_back():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    assert scaler.update(math.inf) is False and scaler.scale == 4.0
    assert scaler.update(1.0) and scaler.update(1.0) and scaler.scale == 8.0
    assert DynamicLossScaler(enabled=False).scale == 1.0


def test_a_resume_keeps_the_loss_scale_only_between_runs_that_scale():
    fp16 = DynamicLossScaler(init_scale=8.0)
    fp16.update(math.inf)
    bf16 = DynamicLossScaler(enabled=False)
    resumed = DynamicLossScaler()  # fp16, from a bf16 run's checkpoint: 1.0 would underflow
    resumed.load_state_dict(bf16.state_dict())
    assert resumed.scale == 2.0**16
    resumed.load_state_dict(fp16.state_dict())
    assert resumed.scale == 4.0
    bf16.load_state_dict(fp16.state_dict())  # and a run that does not scale stays at 1
    assert bf16.scale == 1.0
