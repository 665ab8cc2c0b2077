"""The Trainer through the built-in recipes, in one process: training, metrics, the HF model,
determinism, SIGTERM handling and user errors.

    pytest tests/integration/test_trainer.py -q
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from dtrain.core.metrics_format import parse_metrics
from dtrain.runtime.train.checkpoint import latest_checkpoint

CORPUS = Path(__file__).read_text() * 4
COMMON = ["--micro_batch_size", "4", "--seq_len", "32", "--warmup_steps", "2"]


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A one-process job's contract environment; returns its folder."""
    for key in list(os.environ):
        if key.startswith(("SM_", "DTRAIN_")) or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                          "LOCAL_WORLD_SIZE", "GROUP_RANK"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(tmp_path / "output"))
    monkeypatch.setenv("DTRAIN_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    (tmp_path / "corpus.txt").write_text(CORPUS)
    return tmp_path


def _records(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def test_causal_lm_trains_and_reports_metrics_and_a_loadable_model(job, capsys):
    from dtrain.runtime.models.hf_io import load_pretrained
    from dtrain.runtime.recipes import causal_lm

    code = causal_lm.main(["--model", "gpt-neox-tiny", "--data", str(job / "corpus.txt"),
                           "--steps", "16", "--lr", "3e-3", "--log_interval", "4", *COMMON])
    assert code == 0
    lines = [parse_metrics(line) for line in capsys.readouterr().out.splitlines()]
    metrics = [m for m in lines if m is not None]
    assert [m["step"] for m in metrics] == [4, 8, 12, 16]
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.5
    assert all(m["tokens_per_s"] > 0 and 0 < m["mfu"] < 1 for m in metrics)
    assert [r["step"] for r in _records(job / "output")] == [4, 8, 12, 16]
    tokenizer = json.loads((job / "model" / "dtrain_tokenizer.json").read_text())
    assert tokenizer["tokenizer"]["type"] == "byte"
    model = load_pretrained(job / "model")
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 512)


def test_identical_runs_give_identical_losses(job, tmp_path_factory, monkeypatch):
    from dtrain.runtime.recipes import causal_lm

    args = ["--model", "gpt-neox-tiny", "--data", str(job / "corpus.txt"), "--steps", "5",
            "--log_interval", "1", "--seed", "3", *COMMON]
    runs = []
    for name in ("first", "second"):
        out = tmp_path_factory.mktemp(name)
        monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(out))
        monkeypatch.setenv("SM_MODEL_DIR", str(out / "model"))
        # its own checkpoints: a run finds the first run's last step there and resumes at it
        monkeypatch.setenv("DTRAIN_CHECKPOINT_DIR", str(out / "checkpoints"))
        assert causal_lm.main(args) == 0
        runs.append([r["loss"] for r in _records(out)])
    assert len(runs[0]) == 5 and runs[0] == runs[1]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_trains_with_fp32_master_weights(job, monkeypatch, precision):
    from dtrain.runtime.models.hf_io import load_pretrained
    from dtrain.runtime.recipes import causal_lm
    from dtrain.runtime.recipes.causal_lm import next_token_loss
    from safetensors.torch import load_file

    monkeypatch.setenv("DTRAIN_DISTRIBUTION", json.dumps({"mixed_precision": precision}))
    logits_dtypes = set()

    def watched_loss(model, batch):  # the dtype the model computes in
        hook = model.register_forward_hook(lambda _m, _i, out: logits_dtypes.add(out.dtype))
        try:
            return next_token_loss(model, batch)
        finally:
            hook.remove()

    monkeypatch.setattr(causal_lm, "next_token_loss", watched_loss)
    code = causal_lm.main(["--model", "gpt-neox-tiny", "--data", str(job / "corpus.txt"),
                           "--steps", "12", "--lr", "3e-3", "--log_interval", "4", *COMMON])
    assert code == 0
    assert logits_dtypes == {torch.bfloat16 if precision == "bf16" else torch.float16}
    records = _records(job / "output")
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    # fp16 needs the dynamic loss scaler (and reports its scale); bf16 has fp32's range
    assert all(("loss_scale" in r) == (precision == "fp16") for r in records)
    saved = load_file(job / "model" / "model.safetensors")
    assert {tensor.dtype for tensor in saved.values()} == {torch.float32}
    model = load_pretrained(job / "model")
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long))).all()


def test_masked_lm_trains_bert_tiny(job):
    from dtrain.runtime.recipes import masked_lm

    code = masked_lm.main(["--model", "bert-tiny", "--data", str(job / "corpus.txt"),
                           "--steps", "12", "--lr", "2e-3", "--log_interval", "3", *COMMON])
    assert code == 0
    losses = [r["loss"] for r in _records(job / "output")]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5
    assert (job / "model" / "model.safetensors").is_file()


def test_sigterm_checkpoints_at_the_next_step_and_the_next_run_resumes(job):
    import dtrain.runtime as rt
    from dtrain.runtime.models import from_preset
    from dtrain.runtime.recipes.causal_lm import next_token_loss
    from dtrain.runtime.train.data import DistributedTokenLoader
    from dtrain.runtime.train.tokenize import encode_bytes
    from dtrain.runtime.train.trainer import Trainer, TrainerConfig

    calls = []

    def loss_fn(model, batch):
        calls.append(batch.index)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-step, as a spot notice would
        return next_token_loss(model, batch)

    def fit():
        ctx = rt.init(distribution={"sharding_degree": 1})
        torch.manual_seed(0)
        model = rt.shard(from_preset("gpt-neox-tiny"), ctx)
        loader = DistributedTokenLoader(encode_bytes([CORPUS]), window=33, micro_batch_size=2)
        trainer = Trainer(model, ctx, loss_fn, config=TrainerConfig(steps=6, log_interval=1))
        return trainer.fit(loader)

    first = fit()
    assert first.preempted and first.step == 3
    assert latest_checkpoint(job / "checkpoints").name == "step-000003"
    assert not (job / "model").exists()
    second = fit()
    assert (second.resumed_from, second.step, second.preempted) == (3, 6, False)
    assert calls == list(range(6))  # the data continued where the checkpoint left it
    assert (job / "model" / "config.json").is_file()
    torch.distributed.destroy_process_group()


def test_missing_data_is_a_one_line_error(job, capsys):
    from dtrain.runtime.recipes import causal_lm

    assert causal_lm.main(["--data", "nope", "--steps", "1"]) == 2
    assert "no input channel 'nope'" in capsys.readouterr().err


def test_bad_hyperparameters_are_one_line_errors_before_any_training(job, capsys):
    from dtrain.runtime.recipes import causal_lm

    data = ["--data", str(job / "corpus.txt")]
    assert causal_lm.main([*data, "--steps", "0"]) == 2
    assert "error: hyperparameters.steps: 0 is not a whole number >= 1" in capsys.readouterr().err
    assert causal_lm.main([*data, "--seq_len", "300"]) == 2  # gpt-neox-tiny has 256 positions
    assert "error: hyperparameters.seq_len: 300 is more than the 256 positions" in \
        capsys.readouterr().err
    assert not (job / "model").exists() and not (job / "checkpoints").exists()



def _tiny_fit(steps: int, loss_fn=None, optimizer_of=None, **config):
    """One gloo rank trains gpt-neox-tiny for ``steps`` steps; returns the Trainer and result.

    ``config``: more ``TrainerConfig`` fields; ``optimizer_of(model)``: the optimizer to pass.
    The process group is reused by later calls; the caller destroys it.
    """
    import dtrain.runtime as rt
    from dtrain.runtime.models import from_preset
    from dtrain.runtime.recipes.causal_lm import next_token_loss
    from dtrain.runtime.train.data import DistributedTokenLoader
    from dtrain.runtime.train.tokenize import encode_bytes
    from dtrain.runtime.train.trainer import Trainer, TrainerConfig

    ctx = rt.init(distribution={"sharding_degree": 1})
    model = rt.shard(from_preset("gpt-neox-tiny"), ctx)
    loader = DistributedTokenLoader(encode_bytes([CORPUS]), window=33, micro_batch_size=2)
    trainer = Trainer(model, ctx, loss_fn or next_token_loss,
                      config=TrainerConfig(steps=steps, **config),
                      optimizer=optimizer_of(model) if optimizer_of else None)
    return trainer, trainer.fit(loader)


def test_sigterm_during_the_final_model_save_lets_the_save_finish(job, monkeypatch):
    from dtrain.runtime.models.hf_io import load_pretrained
    from dtrain.runtime.train import trainer

    save = trainer.save_hf_model

    def save_with_a_spot_notice(model, folder):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the model is being written
        return save(model, folder)

    monkeypatch.setattr(trainer, "save_hf_model", save_with_a_spot_notice)
    outside = []  # stands in for the default handler, which would kill the rank mid-save
    previous = signal.signal(signal.SIGTERM, lambda *_: outside.append(True))
    try:
        _, result = _tiny_fit(steps=2)
    finally:
        signal.signal(signal.SIGTERM, previous)
        torch.distributed.destroy_process_group()
    assert outside == []  # the trainer held SIGTERM until model/ was whole
    assert (result.step, result.preempted) == (2, False)
    assert load_pretrained(job / "model") is not None


def test_a_model_save_cut_off_half_way_leaves_the_previous_model_whole(job, monkeypatch):
    from dtrain.runtime.models import hf_io
    from dtrain.runtime.models.hf_io import load_pretrained
    from dtrain.runtime.train.checkpoint import hf_staging_dir, save_hf_model

    def killed_half_way(tensors, path, **kwargs):
        Path(path).write_bytes(b"\0" * 64)  # a truncated weights file, then the process dies
        raise SystemExit(137)

    real_save_file = hf_io.save_file
    try:
        trainer, _ = _tiny_fit(steps=1)  # writes model/
        before = {p.name: p.read_bytes() for p in (job / "model").iterdir()}
        monkeypatch.setattr(hf_io, "save_file", killed_half_way)
        with pytest.raises(SystemExit):
            save_hf_model(trainer.model, job / "model")
        # model/ is uploaded whole as the artifact: the partial save is next to it, not in it.
        after = {p.name: p.read_bytes() for p in (job / "model").iterdir()}
        assert after == before
        staging = hf_staging_dir(job / "model")
        assert staging.parent == job and staging.is_dir()
        assert not (staging / "config.json").exists()
        # The next save starts by removing the leftover and publishes a whole model.
        monkeypatch.setattr(hf_io, "save_file", real_save_file)
        save_hf_model(trainer.model, job / "model")
    finally:
        torch.distributed.destroy_process_group()
    assert not staging.exists()
    assert sorted(p.name for p in (job / "model").iterdir()) == sorted(before)
    assert load_pretrained(job / "model") is not None


def test_sigterm_in_the_last_step_checkpoints_it_and_the_resubmit_only_writes_the_model(job):
    from dtrain.runtime.models.hf_io import load_pretrained
    from dtrain.runtime.recipes.causal_lm import next_token_loss
    from dtrain.runtime.train.checkpoint import TRAINER_STATE

    calls = []

    def loss_fn(model, batch):
        calls.append(batch.index)
        if len(calls) == 3:  # the last step: the stop comes after training, before the save
            os.kill(os.getpid(), signal.SIGTERM)
        return next_token_loss(model, batch)

    try:
        _, first = _tiny_fit(3, loss_fn)
        assert (first.step, first.preempted) == (3, True)
        assert not (job / "model").exists()  # stopped means stopped: no model save started
        checkpoint = latest_checkpoint(job / "checkpoints")
        assert checkpoint.name == "step-000003"
        assert json.loads((checkpoint / TRAINER_STATE).read_text())["total_steps"] == 3
        _, second = _tiny_fit(3, loss_fn)
    finally:
        torch.distributed.destroy_process_group()
    assert (second.resumed_from, second.step, second.preempted) == (3, 3, False)
    assert calls == [0, 1, 2]  # the resubmitted job trained no further step
    assert load_pretrained(job / "model") is not None


def test_a_finished_run_leaves_a_checkpoint_of_its_last_step(job):
    try:
        _, result = _tiny_fit(2)
    finally:
        torch.distributed.destroy_process_group()
    assert (result.step, result.preempted) == (2, False)
    assert latest_checkpoint(job / "checkpoints").name == "step-000002"
    assert (job / "model" / "config.json").is_file()



def test_a_run_of_fewer_steps_than_its_checkpoint_is_refused_not_completed_untrained(
        job, capsys):
    # steps 1 on a step-2 checkpoint trained nothing, exported the old model and ended Completed
    try:
        _tiny_fit(2)
        with pytest.raises(ValueError, match=r"step-000002 is at step 2, past the 1 steps this "
                                             r"run trains to; give steps above 2"):
            _tiny_fit(1)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the Trainer's, left behind
        _, same = _tiny_fit(2)  # a restart after the last checkpoint: only the model is saved
    finally:
        torch.distributed.destroy_process_group()
    assert (same.resumed_from, same.step) == (2, 2)
    assert "at step 2; that is the last of its 2 steps: nothing left to train" in \
        capsys.readouterr().out


def test_an_optimizer_passed_in_keeps_its_groups_learning_rates_shaped_by_the_schedule(job):
    def two_rates(model):
        params = list(model.parameters())
        return torch.optim.SGD([{"params": params[:1], "lr": 0.5},
                                {"params": params[1:], "lr": 0.05}])
    try:
        trainer, _ = _tiny_fit(3, optimizer_of=two_rates, lr=3e-4, warmup_steps=0,
                               min_lr_ratio=0.5)
    finally:
        torch.distributed.destroy_process_group()
    # the last update is at the floor, half of each group's own peak (not 1.5e-4 for both)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx([0.25, 0.025])


def test_a_loss_fn_that_returns_only_the_loss_is_told_what_to_return(job):
    from dtrain.runtime.recipes.causal_lm import next_token_loss

    try:
        with pytest.raises(TypeError, match=r"loss_fn returned Tensor; it must return "
                                            r"\(loss, tokens\)"):
            _tiny_fit(1, loss_fn=lambda model, batch: next_token_loss(model, batch)[0])
    finally:
        torch.distributed.destroy_process_group()


def test_a_stop_right_after_an_interval_checkpoint_does_not_write_that_step_again(
        job, monkeypatch):
    from dtrain.runtime.recipes.causal_lm import next_token_loss
    from dtrain.runtime.train.checkpoint import CheckpointManager

    saves, calls, save = [], [], CheckpointManager.save
    monkeypatch.setattr(CheckpointManager, "save",
                        lambda self, step, *a, **k: saves.append(step) or save(self, step, *a, **k))

    def loss_fn(model, batch):
        calls.append(1)
        if len(calls) == 2:  # in step 2, whose end writes the interval checkpoint
            os.kill(os.getpid(), signal.SIGTERM)
        return next_token_loss(model, batch)

    try:
        _, result = _tiny_fit(6, loss_fn, checkpoint_interval=2)
    finally:
        torch.distributed.destroy_process_group()
    assert (result.step, result.preempted) == (2, True)
    assert saves == [2]  # rewriting it would only spend the grace period
    assert latest_checkpoint(job / "checkpoints").name == "step-000002"


def test_a_loss_that_stays_nan_stops_training_with_the_reason(job, monkeypatch, caplog):
    from dtrain.runtime.recipes.causal_lm import next_token_loss
    from dtrain.runtime.train import trainer

    monkeypatch.setattr(trainer, "MAX_NONFINITE_STEPS", 3)
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        loss, tokens = next_token_loss(model, batch)
        return (loss * float("nan") if len(calls) > 2 else loss), tokens

    with pytest.raises(FloatingPointError, match=r"^training stopped at step 5: the gradient norm "
                                                 r"was not finite for 3 steps in a row"):
        try:
            _tiny_fit(10, loss_fn, checkpoint_interval=2)
        finally:
            torch.distributed.destroy_process_group()
    skipped = [r.getMessage() for r in caplog.records if "optimizer step skipped" in r.getMessage()]
    assert [line.split(":")[0] for line in skipped] == ["step 3", "step 4", "step 5"]
    assert latest_checkpoint(job / "checkpoints").name == "step-000004"


def test_checkpoint_saves_count_neither_in_the_step_time_nor_its_traffic(job, monkeypatch):
    import time

    from dtrain.runtime.recipes.causal_lm import next_token_loss
    from dtrain.runtime.train.checkpoint import CheckpointManager

    save = CheckpointManager.save

    def slow_save(self, *args, **kwargs):  # a save that all-reduces and takes 3 s
        torch.distributed.all_reduce(torch.zeros(1000))
        time.sleep(3.0)
        return save(self, *args, **kwargs)

    def slow_loss(model, batch):  # a step takes at least 0.2 s
        time.sleep(0.2)
        return next_token_loss(model, batch)

    monkeypatch.setattr(CheckpointManager, "save", slow_save)
    try:  # logged after steps 3 and 6; a checkpoint after step 4, inside the second window
        _, result = _tiny_fit(6, slow_loss, checkpoint_interval=4, log_interval=3)
    finally:
        torch.distributed.destroy_process_group()
    first, second = result.history
    assert first["comm_calls_per_step"] == second["comm_calls_per_step"] > 0
    tokens = 3 * 2 * 32  # 3 steps of 2 sequences of 32 predicted tokens
    for window in (first, second):
        # at most: 3 steps take at least 0.6 s (counting step 4 in the second window);
        # at least: the 3 s save is not in it (3 steps take about 0.7 s here, 1.5 s loaded)
        assert tokens / 3.0 < window["tokens_per_s"] <= tokens / 0.6


def test_a_checkpoint_missing_a_shard_is_passed_over_for_the_one_before(job, capsys):
    try:
        _tiny_fit(4, checkpoint_interval=2)  # step-000002 and step-000004
        newest = job / "checkpoints" / "step-000004"
        shard = next(newest.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])  # a merged copy that lost part of a host's
        capsys.readouterr()
        _, result = _tiny_fit(6, checkpoint_interval=2)
    finally:
        torch.distributed.destroy_process_group()
    assert (result.resumed_from, result.step) == (2, 6)
    assert (f"dtrain: not resuming from {newest}: {shard.name} missing or cut short; trying "
            "the checkpoint before it") in capsys.readouterr().out


def test_pruning_keeps_the_checkpoint_just_written_over_a_newer_passed_over_one(job):
    from dtrain.runtime.recipes.causal_lm import next_token_loss

    calls = []

    def stop_in_step_3(model, batch):
        calls.append(1)
        if len(calls) == 1:  # the resumed run's first step is step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return next_token_loss(model, batch)

    try:
        _tiny_fit(4, checkpoint_interval=2)  # step-000002 and step-000004
        newest = job / "checkpoints" / "step-000004"
        next(newest.glob("*.distcp")).unlink()  # passed over on resume
        _, result = _tiny_fit(6, stop_in_step_3, checkpoint_interval=2, keep_last=1)
    finally:
        torch.distributed.destroy_process_group()
    assert (result.resumed_from, result.step, result.preempted) == (2, 3, True)
    kept = sorted(p.name for p in (job / "checkpoints").iterdir())
    assert kept == ["step-000003", "step-000004"]  # keep_last 1 of those up to step 3
    assert latest_checkpoint(job / "checkpoints") == newest  # by name; resume passes it over


def test_resuming_with_a_loader_that_cannot_restore_its_position_says_so(job, caplog):
    import dtrain.runtime as rt
    from dtrain.runtime.models import from_preset
    from dtrain.runtime.recipes.causal_lm import next_token_loss
    from dtrain.runtime.train.data import DistributedTokenLoader
    from dtrain.runtime.train.tokenize import encode_bytes
    from dtrain.runtime.train.trainer import Trainer, TrainerConfig

    class Batches:  # iterable, no state_dict: a user's own loader
        def __iter__(self):
            return iter(DistributedTokenLoader(encode_bytes([CORPUS]), window=33,
                                               micro_batch_size=2))

    try:
        for steps in (2, 3):
            ctx = rt.init(distribution={"sharding_degree": 1})
            model = rt.shard(from_preset("gpt-neox-tiny"), ctx)
            Trainer(model, ctx, next_token_loss, config=TrainerConfig(steps=steps)).fit(Batches())
    finally:
        torch.distributed.destroy_process_group()
    assert any("resumed at step 2, but the loader (Batches) has no load_state_dict" in
               r.getMessage() for r in caplog.records)


def test_a_loader_shorter_than_the_run_is_read_again_and_a_spent_iterator_is_one_error(job):
    import dtrain.runtime as rt
    from dtrain.runtime.models import from_preset
    from dtrain.runtime.recipes.causal_lm import next_token_loss
    from dtrain.runtime.train.data import TokenBatch
    from dtrain.runtime.train.trainer import Trainer, TrainerConfig

    batches = [TokenBatch(torch.randint(0, 256, (2, 33)), i) for i in range(3)]
    try:
        ctx = rt.init(distribution={"sharding_degree": 1})
        model = rt.shard(from_preset("gpt-neox-tiny"), ctx)
        result = Trainer(model, ctx, next_token_loss, config=TrainerConfig(steps=5)).fit(batches)
        assert (result.step, result.preempted) == (5, False)  # 3 batches, then 2 more
        model = rt.shard(from_preset("gpt-neox-tiny"), ctx)
        with pytest.raises(ValueError, match=r"^the loader \(list_iterator\) has no more batches "
                                             r"after 1 epoch\(s\): an iterator runs only once"):
            Trainer(model, ctx, next_token_loss, config=TrainerConfig(steps=9),
                    checkpoint_dir=job / "other").fit(iter(batches))
    finally:
        torch.distributed.destroy_process_group()
    assert latest_checkpoint(job / "checkpoints").name == "step-000005"


def test_a_stop_before_the_first_step_writes_no_checkpoint(job, monkeypatch):
    from dtrain.runtime.train.trainer import Trainer

    resume = Trainer._resume

    def resume_then_stopped(self, *args):
        os.kill(os.getpid(), signal.SIGTERM)  # `dtrain stop` lands before step 1
        return resume(self, *args)

    monkeypatch.setattr(Trainer, "_resume", resume_then_stopped)
    monkeypatch.setenv("SM_OUTPUT_DIR", str(job / "output"))
    try:
        _, result = _tiny_fit(3)
    finally:
        torch.distributed.destroy_process_group()
    assert (result.step, result.preempted) == (0, True)
    # an optimizer saved before its first step holds the state of a made-up one
    assert latest_checkpoint(job / "checkpoints") is None
    # no checkpoint says so, but the node agent must still hear of the stop (a script that
    # exits 0 after fit would otherwise read as completed)
    assert json.loads((job / "output" / "stopped_early.json").read_text()) == {"step": 0}


def test_the_final_model_save_can_be_skipped_and_an_impossible_format_is_refused_up_front(job):
    import dtrain.runtime as rt
    from dtrain.runtime.recipes.causal_lm import next_token_loss
    from dtrain.runtime.train.data import DistributedTokenLoader
    from dtrain.runtime.train.tokenize import encode_bytes
    from torch import nn

    ctx = rt.init(distribution={"sharding_degree": 1})
    try:
        plain = rt.shard(nn.Sequential(nn.Embedding(512, 8), nn.Linear(8, 512)), ctx)
        with pytest.raises(ValueError, match="model_format 'huggingface': Sequential is not one "
                                             "of dtrain's model families; use 'auto' or "
                                             "'safetensors'"):
            rt.Trainer(plain, ctx, next_token_loss,
                       config=rt.TrainerConfig(steps=1, model_format="huggingface"))
        loader = DistributedTokenLoader(encode_bytes([CORPUS]), window=33, micro_batch_size=2)
        result = rt.Trainer(plain, ctx, next_token_loss,
                            config=rt.TrainerConfig(steps=2, model_format="none")).fit(loader)
    finally:
        torch.distributed.destroy_process_group()
    assert (result.step, result.preempted) == (2, False)
    assert latest_checkpoint(job / "checkpoints").name == "step-000002"
    assert not (job / "model").exists()
