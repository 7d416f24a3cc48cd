"""The optimizer step's own peak (memx_launch/planning/optimizer_peak.py)."""

import math

import numpy as np
import pytest

from estimates import cluster_file, estimated_plan
from memx_launch.cli import main
from memx_launch.planning.model_states import FULL_TRAINING, TrainedParameters
from memx_launch.planning.optimizer_peak import for_loop_temporary_bytes, step_temporary_bytes
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

H100_NODE = {"version": 1, "name": "h100", "nodes": [{"name": "n", "devices": {"h100": 8}, "intra_node_gbps": 450}],
             "device_types": {"h100": {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 989,
                                       "memory_bandwidth_gbps": 3350}}}


def _state_tensors(model, optimizer) -> list:
    return [*model.parameters(), *(p.grad for p in model.parameters()),
            *(t for state in optimizer.state.values() for t in state.values() if t.dim())]


@pytest.mark.parametrize("implementation", ["foreach", "for-loop", "fused"])
def test_the_step_allocates_one_moment_of_every_parameter_only_foreach(implementation):
    """torch's AdamW over memx's LLaMA as the emulated device's guard counts it: foreach (its
    default on a GPU) allocates the square root of every second moment at once, exactly what
    memx counts for ``--foreach-optimizer`` (fp32 moments: 4 bytes a parameter); the for-loop
    (its default on the host) two of a parameter's moments beside the previous one's
    denominator, what memx counts on emulated devices (to its 0-dim scalars); fused kernels
    none."""
    torch = pytest.importorskip("torch")
    from memx_launch.models.llama import LlamaStage
    from memx_launch.profiling.emulation import EmulatedDevice

    spec = get_model("llama-tiny")
    torch.manual_seed(0)
    stage = LlamaStage(spec, 2, first=True, last=True)
    kwargs = {"foreach": {"foreach": True}, "for-loop": {"foreach": False}, "fused": {"fused": True}}[implementation]
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3, **kwargs)
    tokens = torch.randint(0, spec.vocab_size, (2, 16))
    for _ in range(2):  # the second step: the moments exist
        torch.nn.functional.cross_entropy(stage(tokens).flatten(0, 1), tokens.flatten()).backward()
        with EmulatedDevice("probe", math.inf) as device:
            device.track(_state_tensors(stage, optimizer))
            device.reset_peak()
            held = device.live_bytes
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    allocated = device.peak_bytes - held
    params = sum(p.numel() for p in stage.parameters())
    ddp = TrainingSpec(setup="ddp")
    counted = float(step_temporary_bytes(ddp, FULL_TRAINING, np.ones(1), 1, False)[0])
    if implementation == "foreach":
        assert allocated == counted * params == 4 * params
    elif implementation == "for-loop":
        loop = float(for_loop_temporary_bytes(spec, ddp, 1, (1, 1), 1, 1, True)[0])
        assert 0 <= allocated - loop < 128 and loop < counted * params
        assert float(for_loop_temporary_bytes(spec, ddp, 1, (1, 1), 1, 1, False)[0]) == 0  # a GPU's: foreach
    else:
        assert allocated == 0


def test_which_setups_and_stages_count_the_temporary():
    ddp = TrainingSpec(setup="ddp")
    tp = np.array([1, 2, 1])
    # TP's DTensors step foreach too (torch adds DTensor to the optimizers' foreach types)
    assert step_temporary_bytes(ddp, FULL_TRAINING, tp, 1, False).tolist() == [4.0] * 3
    assert step_temporary_bytes(ddp, FULL_TRAINING, tp, 1, True).tolist() == [0.0] * 3  # the host's for-loop
    lora = TrainedParameters(0.25)
    assert step_temporary_bytes(ddp, lora, tp, 1, False).tolist() == [1.0] * 3  # only what it updates
    sixteen = TrainingSpec(setup="ddp", weights_dtype="training", optimizer_dtype="bf16-no-master")
    assert step_temporary_bytes(sixteen, FULL_TRAINING, tp, 1, False).tolist() == [2.0] * 3
    for sharded in (TrainingSpec(setup="ddp", distributed_optimizer=True),  # a rank's shard of each
                    TrainingSpec(setup="memx-run", fully_sharded=True)):  # FSDP2's DTensor shards
        assert step_temporary_bytes(sharded, FULL_TRAINING, tp, np.array([4, 2, 4]), False).tolist() == [1.0, 2.0, 1.0]
    for setup in ("megatron", "zero1", "zero3", "fsdp2", "torchtitan", "scaling"):  # fused kernels, DTensors
        assert not step_temporary_bytes(TrainingSpec(setup=setup), FULL_TRAINING, tp, 1, False).any(), setup
    assert not step_temporary_bytes(TrainingSpec(setup="ddp", optimizer="sgd"), FULL_TRAINING, tp, 1, False).any()
    assert TrainingSpec(setup="memx-run").foreach_optimizer and not TrainingSpec().foreach_optimizer


def test_a_stage_that_keeps_few_activations_peaks_at_its_optimizer_step(tmp_path):
    """LLaMA-2 7B under ``--setup ddp`` on H100s, four stages of two replicas, every block
    recomputed in full: a middle stage's step holds its fp32 weights, gradients and DDP's bucket
    copy of them, Adam's two moments and foreach's temporary (24 bytes a parameter), above what
    its activations' peak holds beside autocast's weight copies. The step's part is that
    difference, the parts add up to the peak, and without foreach the step adds nothing."""
    cluster = cluster_file(tmp_path, H100_NODE)
    args = ["--model", "llama2-7b", "--cluster", cluster, "--setup", "ddp", "--tp", "1", "--pp", "4", "--dp", "2",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--seq-len", "4096", "--recompute", "full"]
    foreach, fused = (estimated_plan(tmp_path, name, args + [flag])
                      for name, flag in (("foreach", "--foreach-optimizer"), ("fused", "--no-foreach-optimizer")))
    assert estimated_plan(tmp_path, "preset", args)["stages"] == foreach["stages"]  # --setup ddp's default
    block = get_model("llama2-7b").layer_params
    for i, (step, other) in enumerate(zip(foreach["stages"], fused["stages"])):
        parts = step["memory_parts_gib"]
        assert sum(parts.values()) == pytest.approx(step["predicted_peak_memory_gib"], abs=1e-5)
        assert other["memory_parts_gib"]["optimizer_step"] == 0
        added = step["predicted_peak_memory_gib"] - other["predicted_peak_memory_gib"]
        assert parts["optimizer_step"] == pytest.approx(added, abs=1e-5)
        if i in (1, 2):
            held = parts["communicator_buffers"] + parts["fixed_overhead"]
            assert added > 0.3
            assert step["predicted_peak_memory_gib"] == pytest.approx(step["num_layers"] * block * 24 / 2**30 + held)


def test_the_search_leaves_room_for_the_step(tmp_path, capsys):
    """LLaMA-2 7B under ``--setup ddp``, TP 1, PP 4, DP 2, every block recomputed, on devices of 41
    GiB: the activations' peaks fit (40.1 GiB at most), but the first and last stages' optimizer
    steps (42.8 GiB with foreach's temporary) do not, so the search finds nothing that fits and
    says by how much; with a fused Adam it plans."""
    small = {**H100_NODE, "device_types": {"h100": {**H100_NODE["device_types"]["h100"], "memory_gib": 41}}}
    cluster = cluster_file(tmp_path, small)
    args = ["plan", "--model", "llama2-7b", "--cluster", cluster, "--setup", "ddp", "--global-batch-size", "16",
            "--seq-len", "512", "--tp", "1", "--pp", "4", "--micro-batch-sizes", "1", "--recompute-levels", "full"]
    assert main(args + ["--no-foreach-optimizer", "--json", str(tmp_path / "fused.json")]) == 0
    capsys.readouterr()
    assert main(args + ["--foreach-optimizer"]) != 0
    assert "short" in capsys.readouterr().err
