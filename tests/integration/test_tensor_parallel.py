"""Tensor parallelism composed with MiCS on real gloo process groups, against one process.

Four CPU processes on one simulated host (tensor-parallel groups stay inside a node), spawned
once for the module; each runs every configuration in one process group and writes what it
measured, which the tests below judge. The reference is a single process training the same
model (same seed) on the same global batch, computed inside each worker. Parameters are compared
after SGD steps (AdamW's near-sign step amplifies float noise; its losses are compared instead).

    pytest tests/integration/test_tensor_parallel.py -q
"""

from __future__ import annotations

import os

import pytest
import torch
from _tensor_parallel import (
    MICRO_BATCH,
    SEQ,
    VOCAB,
    AllocationPeak,
    assert_matches_one_process,
    build,
    full,
    lm_loss,
    run_parity,
    run_worker,
    spawn,
)

WORLD = 4
TOL = 1e-6
ONE_D = {"sharding_degree": 2, "tensor_parallel_degree": 2}  # tp 2 x shard 2
TWO_D = {"sharding_degree": 1, "tensor_parallel_degree": 4, "tensor_parallel_mode": "2d"}
FAMILIES = ["gpt-neox-tiny", "gpt2-tiny", "gpt-j-tiny", "gpt-neo-tiny", "bert-tiny",
            "roberta-tiny"]
# (preset, distribution, optimizer)
CONFIGS = [(preset, {**ONE_D, "sequence_parallel": sp}, "sgd")
           for preset in FAMILIES for sp in (True, False)]
CONFIGS += [(preset, TWO_D, "sgd") for preset in ("gpt-neox-tiny", "gpt2-tiny")]
CONFIGS += [("gpt-neox-tiny", {**ONE_D, "sequence_parallel": True}, "adamw")]
EXPORTED = {0: "gpt-neox-tiny", 12: "gpt2-tiny"}  # config index -> HF export checked
LOGITS_INPUT = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def built_on_meta(config) -> bool:
    """The layouts whose model is built on the meta device and initialised after splitting
    (the rest split a model built whole): 1-D without sequence parallelism, and 2-D GPT-NeoX."""
    preset, dist, _ = config
    return dist.get("sequence_parallel") is False or (
        dist.get("tensor_parallel_mode") == "2d" and preset == "gpt-neox-tiny")


def config_id(config) -> str:
    preset, dist, optimizer = config
    layout = (f"2d-tp{dist['tensor_parallel_degree']}" if dist.get("tensor_parallel_mode") == "2d"
              else f"tp2-shard2-{'sp' if dist['sequence_parallel'] else 'nosp'}")
    return f"{preset}-{layout}-{optimizer}"


def _full_state(model, optimizer=None) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    state = {f"model.{k}": v for k, v in get_model_state_dict(model, options=options).items()}
    if optimizer is not None:
        optim = get_optimizer_state_dict(model, optimizer, options=options)["state"]
        state.update({f"momentum.{k}": v["momentum_buffer"] for k, v in optim.items()})
    return {k: full(v).detach().clone() for k, v in state.items()}


def _trained(rt, distribution: dict, steps: int = 2):
    ctx, model, _ = build(rt, "gpt-neox-tiny", distribution)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    data = torch.Generator().manual_seed(3)
    for _ in range(steps):
        batch = torch.randint(3, VOCAB, (ctx.dp_world_size, MICRO_BATCH, SEQ + 1),
                              generator=data)
        with ctx.micro_step(model, boundary=True):
            lm_loss(model, batch[ctx.dp_rank], "gpt-neox-tiny").backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _run_checkpoints(rt, root: str) -> dict:
    """Save at one layout, load at another; the full states must be bit-identical."""
    from dtrain.runtime.train.checkpoint import CheckpointManager

    layouts = {"tp2-shard2": {**ONE_D, "sequence_parallel": True}, "shard4": {"sharding_degree": 4},
               "2d-tp4": TWO_D}
    out = {}
    for saved_at, loaded_at in [("tp2-shard2", "tp2-shard2"), ("tp2-shard2", "shard4"),
                                ("shard4", "tp2-shard2"), ("2d-tp4", "shard4")]:
        model, opt = _trained(rt, layouts[saved_at])
        expected = _full_state(model, opt)
        manager = CheckpointManager(os.path.join(root, f"{saved_at}-to-{loaded_at}"))
        path = manager.save(2, model, opt, {})
        fresh, fresh_opt = _trained(rt, layouts[loaded_at], steps=1)  # different weights
        manager.load(path, fresh, fresh_opt)
        got = _full_state(fresh, fresh_opt)
        out[(saved_at, loaded_at)] = {
            "keys_match": got.keys() == expected.keys(),
            "identical": all(torch.equal(got[k], expected[k]) for k in expected),
        }
    return out


ACTIVATION_LAYOUTS = {"mics": {"sharding_degree": 4}, "1d": {**ONE_D, "sequence_parallel": False},
                      "1d-sp": {**ONE_D, "sequence_parallel": True}, "2d": TWO_D}


def _run_activations(rt) -> dict:
    """Bytes kept for backward per rank, the whole model's and one MLP's, per layout."""
    from dtrain.runtime.train.memory import saved_activations

    out = {}
    tokens = torch.randint(3, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(5))
    for name, distribution in ACTIVATION_LAYOUTS.items():
        ctx, model, _ = build(rt, "gpt-neox-tiny", distribution)
        with ctx.micro_step(model, boundary=True):
            with saved_activations(model) as whole:
                loss = lm_loss(model, tokens, "gpt-neox-tiny")
            loss.backward()
        out[name] = {"model": whole.bytes}
        if name in ("1d", "2d"):
            out[name] |= _mlp_activations(model, ctx.plan.tp_grid or 1, ctx.plan.tp)
        if name == "2d":
            out[name] |= _cross_entropy_allocations(ctx, model, tokens)
    return out


def _cross_entropy_allocations(ctx, model, tokens: torch.Tensor) -> dict:
    """The 2-D cross-entropy on the head's logits: what it keeps for backward, the most bytes its
    forward allocates at once, and every parameter's gradient. Then the same on a copy of the
    logits, and on the logits changed in place (by a factor of 1, so the values stay), with and
    without autograd seeing it: it must not recompute those."""
    from dtrain.runtime.train.memory import saved_activations

    def changed_without_autograd(x):
        with torch.no_grad():
            x.mul_(1.0)
        return x

    out = {}
    for path, prepare in (("head", lambda x: x), ("copy", lambda x: x.clone()),
                          ("changed", lambda x: x.mul_(1.0)),
                          ("changed without autograd", changed_without_autograd)):
        model.zero_grad(set_to_none=True)
        with ctx.micro_step(model, boundary=True):
            logits = prepare(model(tokens[:, :-1]).flatten(0, 1))
            with AllocationPeak() as allocated, saved_activations(model) as kept:
                loss = torch.nn.functional.cross_entropy(logits, tokens[:, 1:].flatten())
            loss.backward()
        out[path] = {"loss_peak": allocated.peak, "kept": kept.bytes, "loss": loss.item(),
                     "grads": [p.grad.to_local().clone() for p in model.parameters()]}
    return {"cross_entropy": out, "logits": logits.to_local().nbytes}


def _mlp_activations(model, grid: int, tp: int) -> dict:
    """What the first block's MLP keeps for its input as this rank holds it: the whole input
    (1-D without SP) or its grid block (2-D)."""
    from dtrain.runtime.train.memory import saved_activations

    block = model.gpt_neox.layers[0]
    block.unshard()  # FSDP2 gathers a block's parameters when the block runs; here it does not
    x = torch.randn(4 // grid, SEQ, 64 // grid, requires_grad=True)
    with saved_activations(model) as kept:
        block.mlp(x)
    with saved_activations(model) as normed:
        block.mlp(block.post_attention_layernorm(x))
    block.reshard()
    # the MLP's inner size splits tp ways in 1-D, q ways in 2-D
    return {"mlp": kept.bytes, "normed_mlp": normed.bytes, "ways": tp if grid == 1 else grid,
            "grid": grid}


def _shard_a_model_built_with_a_seed_per_rank(rt) -> str:
    from dtrain.runtime.models import from_preset

    ctx = rt.init(distribution=ONE_D)
    torch.manual_seed(torch.distributed.get_rank())  # a script's mistake: weights per rank
    try:
        rt.shard(from_preset("gpt-neox-tiny"), ctx)
    except ValueError as exc:
        return str(exc)
    return "sharded"


def _export(model, ref, folder: str) -> torch.Tensor:
    from dtrain.runtime.train.checkpoint import save_hf_model

    save_hf_model(model, folder)
    with torch.no_grad():
        return ref(LOGITS_INPUT).detach()


def _worker(rank: int, port: int, result_dir: str) -> None:
    def body(rt, results: dict) -> None:
        for index, config in enumerate(CONFIGS):
            results[config_id(config)], (model, ref) = run_parity(
                rt, *config, meta=built_on_meta(config))
            if index in EXPORTED:
                folder = os.path.join(result_dir, f"hf-{config_id(config)}")
                results[f"logits-{config_id(config)}"] = _export(model, ref, folder)
        results["checkpoints"] = _run_checkpoints(rt, os.path.join(result_dir, "ckpt"))
        results["activations"] = _run_activations(rt)
        results["differing"] = _shard_a_model_built_with_a_seed_per_rank(rt)

    # one host: tensor-parallel groups inside it
    run_worker(rank, port, result_dir, world=WORLD, per_host=WORLD, body=body)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    result_dir = tmp_path_factory.mktemp("tensor-parallel")
    return {"ranks": spawn(_worker, world=WORLD, per_host=WORLD, result_dir=result_dir),
            "dir": result_dir}


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("config", [c for c in CONFIGS if c[2] == "sgd"], ids=config_id)
def test_losses_and_parameters_match_one_process_within_1e_6(results, config):
    for res in results["ranks"]:
        run = res[config_id(config)]
        # the clipped norm spans parameters split on dp x tp, dp alone, or the 2-D grid
        assert_matches_one_process(run, tol=TOL)
        assert run["names_kept"]
        assert min(run["ref_grad_norms"]) > 1.0  # so clipping did scale the gradients


def test_adamw_losses_match_one_process(results):
    config = next(c for c in CONFIGS if c[2] == "adamw")
    for res in results["ranks"]:
        run = res[config_id(config)]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(run["ref_losses"]),
                                   atol=1e-5, rtol=0)


def test_the_plan_runs_the_requested_layout(results):
    one_d = results["ranks"][0][config_id(CONFIGS[0])]["plan"]
    assert (one_d["tp"], one_d["dp_shard"], one_d["tp_mode"], one_d["sequence_parallel"]) == \
        (2, 2, "1d", True)
    assert one_d["mesh_axis_names"] == ["pp", "dp_replicate", "dp_shard", "tp"]
    two_d = results["ranks"][0][config_id(CONFIGS[12])]["plan"]
    assert two_d["mesh_shape"] == [1, 1, 1, 2, 2]
    assert two_d["mesh_axis_names"] == ["pp", "dp_replicate", "dp_shard", "tp_row", "tp_col"]


def test_tensor_parallel_traffic_is_its_own_row_of_the_communication_stats(results):
    for res in results["ranks"]:
        one_d = res[config_id(CONFIGS[0])]["stats"]
        assert one_d["tensor_parallel"]["calls"] > 0 and one_d["tensor_parallel"]["intra_bytes"] > 0
        assert one_d["all_gather"]["calls"] > 0  # MiCS's own all-gathers, over shard 2
        two_d = res[config_id(CONFIGS[12])]["stats"]  # data-parallel degree 1: all of it is TP
        assert two_d["tensor_parallel"]["calls"] > 0
        assert all(two_d[kind]["calls"] == 0 for kind in two_d
                   if kind not in ("tensor_parallel", "total"))


@pytest.mark.parametrize("layouts", [("tp2-shard2", "tp2-shard2"), ("tp2-shard2", "shard4"),
                                     ("shard4", "tp2-shard2"), ("2d-tp4", "shard4")],
                         ids=lambda pair: f"save-{pair[0]}-load-{pair[1]}")
def test_checkpoints_load_bit_identical_at_another_layout(results, layouts):
    for res in results["ranks"]:
        check = res["checkpoints"][layouts]
        assert check["keys_match"] and check["identical"]


@pytest.mark.parametrize("index", sorted(EXPORTED))
def test_the_hugging_face_export_of_a_tensor_parallel_run_loads_in_transformers(results, index):
    import transformers

    name = config_id(CONFIGS[index])
    model = transformers.AutoModelForCausalLM.from_pretrained(results["dir"] / f"hf-{name}")
    with torch.no_grad():
        logits = model.eval()(LOGITS_INPUT).logits
    torch.testing.assert_close(logits, results["ranks"][0][f"logits-{name}"], atol=1e-5, rtol=0)


def test_a_model_whose_weights_differ_between_ranks_is_refused_with_the_fix(results):
    for res in results["ranks"]:  # every rank, so none waits in a collective for the others
        assert res["differing"].startswith("shard: the model's weights differ between ranks")
        assert "torch.manual_seed(seed)" in res["differing"]


def test_each_layout_keeps_less_for_backward_and_two_d_least(results):
    for res in results["ranks"]:
        kept = {name: run["model"] for name, run in res["activations"].items()}
        assert kept["2d"] < kept["1d-sp"] < kept["1d"] < kept["mics"]
        # 0.27 here, where the logits are a larger share than in the benchmark (0.38 there):
        # 2-D keeps no probabilities, 1-D keeps them split over the vocabulary
        assert kept["2d"] <= 0.30 * kept["1d"]


def test_the_two_d_cross_entropy_keeps_nothing_logits_sized_on_the_heads_logits(results):
    # 16 tokens x 256 vocabulary entries of fp32 logits per rank (16 KiB); the loss keeps per-token
    # statistics (16 tokens' worth) and recomputes the logits from the head's input and weight,
    # which the head keeps anyway. Its forward sums exponentials a slice of rows at a time: one
    # logits-sized temporary here, where all 16 rows fit in one slice.
    for res in results["ranks"]:
        run = res["activations"]["2d"]
        head = run["cross_entropy"]["head"]
        assert head["kept"] < run["logits"] / 8
        assert run["logits"] <= head["loss_peak"] < 1.25 * run["logits"]


@pytest.mark.parametrize("other", ["copy", "changed", "changed without autograd"])
def test_the_two_d_cross_entropy_recomputes_only_logits_left_as_the_head_made_them(results, other):
    # on a copy of the logits, or on logits changed in place after the head, it keeps the
    # probabilities; every path gives the same loss and the same gradients, bit for bit
    for res in results["ranks"]:
        run = res["activations"]["2d"]
        head, kept = run["cross_entropy"]["head"], run["cross_entropy"][other]
        assert kept["kept"] >= run["logits"]
        assert head["loss"] == kept["loss"]
        assert all(torch.equal(a, b) for a, b in zip(head["grads"], kept["grads"], strict=True))


@pytest.mark.parametrize("layout", ["1d", "2d"])
def test_a_split_mlp_keeps_only_its_input_and_pre_activation_as_one_process_does(results, layout):
    # gpt-neox-tiny: hidden 64, MLP 256; 4 sequences of SEQ tokens, fp32. The activation's output
    # (another pre-activation-sized tensor) is recomputed in backward, not kept.
    for res in results["ranks"]:
        run = res["activations"][layout]
        tokens = 4 * SEQ // run["grid"]
        expected = tokens * 64 // run["grid"] * 4 + tokens * 256 // run["ways"] * 4
        assert run["mlp"] == expected


def test_a_two_d_norm_before_a_product_keeps_its_input_not_its_output(results):
    # 2-D: the SUMMA product after a grid layer norm recomputes the norm's output in backward
    # from the input and the per-token mean and rstd, which the norm keeps anyway; 1-D keeps
    # the norm's output for the column-parallel matmul.
    for res in results["ranks"]:
        for layout in ("1d", "2d"):
            run = res["activations"][layout]
            tokens = 4 * SEQ // run["grid"]
            stats = 2 * tokens * 4  # mean and rstd per token
            # run["mlp"]: the MLP's input (here the norm's input) and its pre-activation
            output = tokens * 64 // run["grid"] * 4 if layout == "1d" else 0
            assert run["normed_mlp"] == run["mlp"] + stats + output
