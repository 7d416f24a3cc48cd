"""Traffic between communication domains priced in the plan: the bridge's cluster-file fields,
crossing pipeline edges and DP groups, bridge measurements in the profile DB."""

import copy
import json

import numpy as np
import pytest

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.search import search
from memx_launch.profiling.profiledb import BridgeMeasurement, ProfileDB, ProfileWarning, fit_bridge, fitted_bridges
from memx_launch.planning import collectives as co
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.node import PCIE_STAGED_SHARE
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

from tests.test_profiledb import record

MODEL = get_model("llama-tiny")
TRAINING = TrainingSpec(global_batch_size=16, seq_len=64, dtype="fp32", distributed_optimizer=False,
                        overlap_grad_reduce=False)
# cpu-two-vendors, written out: the numbers below are computed from these.
TWO_VENDORS = {
    "version": 1, "name": "two-vendors",
    "device_types": {"nv-small": {"vendor": "nvidia", "memory_gib": 1, "peak_tflops": 0.03, "efficiency": 1.0,
                                  "memory_bandwidth_gbps": 5, "memory_overhead_gib": 0},
                     "amd-big": {"vendor": "amd", "memory_gib": 1, "peak_tflops": 0.01, "efficiency": 1.0,
                                 "memory_bandwidth_gbps": 5, "memory_overhead_gib": 0}},
    "nodes": [{"name": "localhost", "devices": {"nv-small": 2, "amd-big": 2}, "intra_node_gbps": 2}],
    "emulation": {"slowdown": {"nv-small": 1, "amd-big": 3}},
}
# A 2 GB/s link is PCIe's class: native traffic stages through the host (PCIE_STAGED_SHARE).
LINK_GBPS, EFFICIENCY = 2.0 * PCIE_STAGED_SHARE, 0.8
# The defaults on this emulated cluster; the bridge's network is gloo's 1.1 GB/s at most, here the link's 1.0.
BRIDGE_GBPS, BRIDGE_LATENCY_S, HOST_COPY_GBPS = min(1.1, LINK_GBPS * EFFICIENCY), 175e-6, 10.0
NATIVE_LATENCY_S = 10e-6  # a pipeline transfer's
NATIVE_GBPS = LINK_GBPS * EFFICIENCY


def native_collective(op, m, n):
    """A native collective over the PCIe-class link (as NCCL runs it: collectives.py)."""
    return float(co.collective_seconds(op, m, n, NATIVE_GBPS, 1, co.PCI))


def two_vendors(shared_domain=False, **top):
    data = copy.deepcopy(TWO_VENDORS)
    if shared_domain:
        for spec in data["device_types"].values():
            spec["domain"] = "shared"
    data.update(top)
    return ClusterSpec.from_dict(data)


def estimate(cluster, training=TRAINING, **layout):
    layout = {"tp": 1, "micro_batch_size": 1, "references": (1.0, 1.0, 1.0), **layout}
    return evaluate_layout(MODEL, cluster, training, **layout)


def test_cross_domain_dp_group_costs_exactly_the_hierarchical_sync():
    layout = dict(pp=1, dp=4, stage_devices=["nv-small+amd-big"])
    crossing, native = estimate(two_vendors(), **layout), estimate(two_vendors(shared_domain=True), **layout)
    params = MODEL.layer_params * MODEL.num_layers + MODEL.embedding_params + cm.last_stage_params(MODEL, 1)
    m = params * TRAINING.precision_bytes("grad_dtype")
    # Two domains of two: reduce-scatter in each (2 shards), bridge all-reduce of a shard, all-gather.
    shard = m / 2
    hierarchical = (2 * native_collective("reduce_scatter", m, 2)
                    + 2 * shard / (HOST_COPY_GBPS * 1e9) + 2 * BRIDGE_LATENCY_S + shard / (BRIDGE_GBPS * 1e9))
    flat = native_collective("all_reduce", m, 4)
    assert crossing.predicted_iteration_time_s - native.predicted_iteration_time_s == pytest.approx(
        hierarchical - flat, rel=1e-9)
    [group] = crossing.crossings
    assert (group.kind, group.stages, group.domains) == ("data_parallel", [0], ["nccl", "rccl"])
    assert group.seconds_per_step == pytest.approx(hierarchical) and group.bytes_per_step == pytest.approx(shard)
    assert native.crossings == []
    from memx_launch.planning.report import crossing_lines  # memx estimate and memx plan print them

    lines = crossing_lines(crossing, two_vendors())
    assert lines[1].startswith("  DP sync of stage 0 (nccl | rccl):")
    assert lines[-1].startswith("  only memx-run carries these") and crossing_lines(native, two_vendors()) == []
    # Priced as this plan's own setup: the line names the one that prices them as memx-run sends them.
    assert lines[-1].endswith("; --setup memx-run prices them as it sends them")
    memx_run = estimate(two_vendors(), TrainingSpec(**{**TRAINING.__dict__, "setup": "memx-run"}), **layout)
    assert crossing_lines(memx_run, two_vendors())[-1].endswith("(memx export refuses this plan)")


def test_domains_of_different_sizes_all_reduce_then_broadcast():
    cluster = two_vendors(nodes=[{"name": "n", "devices": {"nv-small": 1, "amd-big": 3}, "intra_node_gbps": 2}])
    shared = ClusterSpec.from_dict({**copy.deepcopy(TWO_VENDORS), "nodes": cluster_nodes(cluster),
                                    "device_types": {n: {**s, "domain": "shared"}
                                                     for n, s in TWO_VENDORS["device_types"].items()}})
    layout = dict(pp=1, dp=4, stage_devices=["nv-small*1+amd-big*3"])
    crossing, native = estimate(cluster, **layout), estimate(shared, **layout)
    params = MODEL.layer_params * MODEL.num_layers + MODEL.embedding_params + cm.last_stage_params(MODEL, 1)
    m = params * TRAINING.precision_bytes("grad_dtype")
    inside = native_collective("all_reduce", m, 3)  # among the 3 AMD ranks
    bridge = 2 * m / (HOST_COPY_GBPS * 1e9) + 2 * BRIDGE_LATENCY_S + m / (BRIDGE_GBPS * 1e9)
    spread = native_collective("broadcast", m, 3)  # to the 3
    flat = native_collective("all_reduce", m, 4)
    assert crossing.predicted_iteration_time_s - native.predicted_iteration_time_s == pytest.approx(
        inside + bridge + spread - flat, rel=1e-9)


def cluster_nodes(cluster):
    return [{"name": n.name, "devices": dict(n.devices), "intra_node_gbps": n.intra_node_gbps} for n in cluster.nodes]


def hidden_bytes(mbs=1):
    return mbs * TRAINING.seq_len * MODEL.hidden_size * TRAINING.dtype_bytes


def edge_seconds():
    """One transfer over the bridge and over the native link."""
    h = hidden_bytes()
    bridge = BRIDGE_LATENCY_S + h / (BRIDGE_GBPS * 1e9) + 2 * h / (HOST_COPY_GBPS * 1e9)
    return bridge, NATIVE_LATENCY_S + h / (LINK_GBPS * EFFICIENCY * 1e9)


def test_crossing_pipeline_edge_costs_more_per_micro_batch_both_ways():
    layout = dict(pp=2, dp=2, stage_devices=["nv-small", "amd-big"])
    crossing, native = estimate(two_vendors(), **layout), estimate(two_vendors(shared_domain=True), **layout)
    bridge, link = edge_seconds()
    g = crossing.num_microbatches
    # Both stages send over the edge (forward, backward) once per micro-batch: (G + 1) extra per second.
    assert crossing.predicted_iteration_time_s - native.predicted_iteration_time_s == pytest.approx(
        (g + 1) * (bridge - link), rel=1e-9)
    [edge] = crossing.crossings
    assert (edge.kind, edge.stages) == ("pipeline", [0, 1])
    # Each of the two DP replicas' rank pairs sends both ways: the first stage's rank its activations,
    # the second's their gradients, one of each a micro-batch.
    assert (edge.bytes_per_step, edge.senders) == (g * hidden_bytes(), 4)
    assert edge.seconds_per_step == pytest.approx(2 * g * bridge)


def test_a_partitioned_edge_stages_a_tp_th_over_the_bridge_and_gathers_natively():
    # memx-run's sends (partitioned_sends): each TP rank of the nv-small pair sends its half of
    # every hidden state to its amd-big peer, whose pair all-gathers the whole over its own link.
    # memx-run partitions an edge only where that is faster (partition_where_faster): its plan's choice.
    def plans(cluster, seq_len=TRAINING.seq_len):
        return [estimate(cluster, tp=2, pp=2, dp=1, stage_devices=["nv-small", "amd-big"],
                         training=TrainingSpec(**{**TRAINING.__dict__, "partitioned_sends": p,
                                                  "partition_where_faster": p == "faster", "seq_len": seq_len}))
                for p in (False, True, "faster")]
    whole, split, chosen = plans(two_vendors())
    h, g = hidden_bytes(), split.num_microbatches
    half = BRIDGE_LATENCY_S + h / 2 / (BRIDGE_GBPS * 1e9) + 2 * h / 2 / (HOST_COPY_GBPS * 1e9)
    [edge] = split.crossings
    assert edge.bytes_per_step == g * h / 2 == whole.crossings[0].bytes_per_step / 2
    assert edge.seconds_per_step == pytest.approx(2 * g * (half + native_collective("all_gather", h, 2)), rel=1e-9)
    # Here the pair's own link (PCIe-class, 1.6 GB/s) is no faster than the bridge: the gather costs what the
    # half saved. Over a node's NVLink-class link, with hidden states of megabytes, the half is what the edge costs.
    assert split.predicted_iteration_time_s > whole.predicted_iteration_time_s
    assert [st.send_parts for st in split.stages] == [2, 2] and [st.send_parts for st in chosen.stages] == [1, 1]
    assert chosen.crossings == whole.crossings and chosen.predicted_iteration_time_s == whole.predicted_iteration_time_s
    whole, split, chosen = plans(two_vendors(nodes=[{**TWO_VENDORS["nodes"][0], "intra_node_gbps": 100}]),
                                 seq_len=4096)
    assert split.crossings[0].seconds_per_step < 0.6 * whole.crossings[0].seconds_per_step
    assert split.predicted_iteration_time_s < whole.predicted_iteration_time_s
    assert chosen.crossings == split.crossings and chosen.predicted_iteration_time_s == split.predicted_iteration_time_s
    assert chosen.stages[0].send_parts == 2


def test_a_plan_s_send_parts_round_trip_and_bad_ones_are_refused_by_field(tmp_path, capsys):
    fast_pairs = two_vendors(nodes=[{**TWO_VENDORS["nodes"][0], "intra_node_gbps": 100}])
    plan = estimate(fast_pairs, tp=2, pp=2, dp=1, stage_devices=["nv-small", "amd-big"],
                    training=TrainingSpec(**{**TRAINING.__dict__, "partitioned_sends": True,
                                             "partition_where_faster": True}))
    assert plan.stages[0].send_parts == 2
    path = str(tmp_path / "plan.json")
    plan.save(path)
    assert [s.send_parts for s in type(plan).load(path).stages] == [s.send_parts for s in plan.stages]
    # Predicted again on pairs linked no faster than the bridge, where a new plan would send it whole,
    # the file is priced as memx-run --plan sends it: in its parts.
    from memx_launch.cli.main import main
    from memx_launch.planning.estimate import evaluate_plan, plan_training

    again = evaluate_plan(plan, two_vendors(), plan_training(plan))
    assert [s.send_parts for s in again.stages] == [2, 1]
    assert estimate(two_vendors(), tp=2, pp=2, dp=1, stage_devices=["nv-small", "amd-big"],
                    training=plan_training(plan)).stages[0].send_parts == 1
    slow_pairs = str(tmp_path / "slow.json")
    with open(slow_pairs, "w") as f:
        json.dump(TWO_VENDORS, f)
    assert main(["estimate", "--plan", path, "--cluster", slow_pairs]) == 0
    out = capsys.readouterr().out  # 1F1B: no wrap-around edge
    assert "pipeline sends in TP parts (a TP-th from each rank, all-gathered on receipt) over edges 0 -> 1; the other " \
        "edges whole" in out
    data = plan.to_dict()
    assert data["stages"][0]["send_parts"] == 2 and "send_parts" not in data["stages"][1]  # whole: not written
    for parts, problem in ((3, "3 parts at TP 2"), (0, "send_parts"), ("2", "send_parts")):
        data["stages"][0]["send_parts"] = parts
        with pytest.raises(ConfigError) as err:
            type(plan).from_dict(data)
        assert err.value.field.endswith("stages[0].send_parts") and problem in str(err.value), str(err.value)
    # Between stages of different TP degrees an edge is sent whole, never in parts.
    data["stages"][0]["send_parts"] = 2
    data.update(tp=None, stage_tp=[2, 1], world_size=3)
    data["stages"][1]["ranks"] = [2]
    with pytest.raises(ConfigError, match=r"stages\[0\]\.send_parts: 2 parts at TP 2, the next stage at TP 1"):
        type(plan).from_dict(data)


def test_interleaving_crosses_v_times_and_wraps_around():
    layout = dict(pp=2, dp=2, stage_devices=["nv-small", "amd-big"], schedule="interleaved", virtual_stages=2)
    crossing, native = estimate(two_vendors(), **layout), estimate(two_vendors(shared_domain=True), **layout)
    bridge, link = edge_seconds()
    g, v = crossing.num_microbatches, 2
    # Each stage pays v passes over the edge and v - 1 over the wrap-around, both directions: a
    # bridge's host copies block, where the native sends hide behind the next chunk's compute.
    assert 2 * link < min(s.predicted_stage_time_s for s in native.stages) / v
    extra = v * bridge + (v - 1) * bridge
    assert crossing.predicted_iteration_time_s - native.predicted_iteration_time_s == pytest.approx(
        g * extra + extra / v, rel=1e-9)
    assert [c.stages for c in crossing.crossings] == [[0, 1], [1, 0]]


def test_one_domain_plans_ignore_the_bridge_settings():
    plain = search(MODEL, two_vendors(shared_domain=True), TRAINING, top_k=3)
    bridged = search(MODEL, two_vendors(shared_domain=True, bridge={"backend": "mpi", "gbps": 0.01}),
                     TRAINING, top_k=3)
    assert [p.to_dict() for p in plain.plans] == [p.to_dict() for p in bridged.plans]
    assert all(not p.crossings for p in plain.plans)


def test_emulated_vendor_types_hold_no_communicator_buffers():
    layout = dict(pp=2, dp=2, stage_devices=["nv-small", "amd-big"])
    cpu_types = {n: {**s, "vendor": "cpu"} for n, s in TWO_VENDORS["device_types"].items()}
    as_cpu = ClusterSpec.from_dict({**copy.deepcopy(TWO_VENDORS), "device_types": cpu_types})
    assert ([s.predicted_peak_memory_gib for s in estimate(two_vendors(), **layout).stages]
            == [s.predicted_peak_memory_gib for s in estimate(as_cpu, **layout).stages])


def test_emulated_vendor_types_compute_as_the_cpus_they_are():
    # The vendor picks an emulated type's domain; its layers run on a CPU: no GPU tiles, waves
    # or kernel launches (they once made llama-tiny's stages 40x slower than the emulation runs).
    cpu_types = {n: {**s, "vendor": "cpu"} for n, s in TWO_VENDORS["device_types"].items()}
    one_type = [{"name": "localhost", "devices": {"nv-small": 4}, "intra_node_gbps": 2}]  # one domain
    as_cpu = ClusterSpec.from_dict({**copy.deepcopy(TWO_VENDORS), "device_types": cpu_types, "nodes": one_type})
    as_vendors = two_vendors(nodes=one_type)
    layout = dict(pp=2, dp=2, micro_batch_size=4, stage_devices=["nv-small", "nv-small"])
    assert estimate(as_vendors, **layout).predicted_iteration_time_s == \
        pytest.approx(estimate(as_cpu, **layout).predicted_iteration_time_s, rel=1e-9)


def test_plans_with_crossings_round_trip(tmp_path):
    plan = estimate(two_vendors(), pp=2, dp=2, stage_devices=["nv-small", "amd-big"])
    path = str(tmp_path / "plan.json")
    plan.save(path)
    assert type(plan).load(path).crossings == plan.crossings
    assert plan.bridge_bytes_per_step == sum(c.bytes_per_step * c.senders for c in plan.crossings) > 0
    older = plan.to_dict()
    del older["crossings"]
    assert type(plan).from_dict(older).crossings == []
    # A plan written before memx counted the senders keeps its crossings and plans no total.
    for crossing in older.setdefault("crossings", plan.to_dict()["crossings"]):
        del crossing["senders"]
    assert type(plan).from_dict(older).bridge_bytes_per_step is None
    older["crossings"][0]["senders"] = 0
    with pytest.raises(ConfigError, match=r"crossings\[0\]\.senders"):
        type(plan).from_dict(older)


@pytest.mark.parametrize("bridge, field", [
    ({"backend": "nccl"}, "cluster.bridge.backend"),
    ({"backend": 3}, "cluster.bridge.backend"),
    ({"gbps": 0}, "cluster.bridge.gbps"),
    ({"latency_us": -1}, "cluster.bridge.latency_us"),
    ({"host_copy_gbps": "fast"}, "cluster.bridge.host_copy_gbps"),
    ({"bandwidth": 1}, "cluster.bridge.bandwidth"),
    ("gloo", "cluster.bridge"),
])
def test_bad_bridge_fields_are_one_line_naming_the_field(bridge, field):
    with pytest.raises(ConfigError) as err:
        two_vendors(bridge=bridge)
    assert err.value.field == field and "\n" not in str(err.value)


def test_bridge_fields_are_read():
    bridge = two_vendors(bridge={"backend": "ucc", "gbps": 12.5, "latency_us": 20, "host_copy_gbps": 50}).bridge
    assert (bridge.backend, bridge.gbps, bridge.staging_gbps(True)) == ("ucc", 12.5, 50)
    assert bridge.latency_s == pytest.approx(20e-6)


def points(latency_s, gbps, sizes=(1 << 10, 1 << 16, 1 << 22)):
    return [BridgeMeasurement(("rccl", "nccl"), "gloo", n, latency_s + n / (gbps * 1e9), ranks=(0, 2))
            for n in sizes]


def test_bridge_measurements_round_trip_beside_layer_samples(tmp_path, recwarn):
    db = ProfileDB(str(tmp_path / "p.jsonl"))
    db.append([record(mbs=1)])
    assert db.append_bridge(points(1e-4, 2.0)) == 3
    db.append([record(mbs=2)])
    assert [r.micro_batch_size for r in db.read()] == [1, 2]
    assert db.bridge_measurements() == points(1e-4, 2.0)
    lines = [json.loads(line) for line in open(db.path)]
    assert [line.get("kind") for line in lines] == [None, "bridge", "bridge", "bridge", None]
    assert not [w for w in recwarn.list if issubclass(w.category, ProfileWarning)]


def test_fit_recovers_latency_and_bandwidth():
    latency, gbps = fit_bridge(points(2.5e-4, 0.9))
    assert latency == pytest.approx(2.5e-4, rel=1e-6) and gbps == pytest.approx(0.9, rel=1e-6)
    with pytest.raises(ValueError):
        fit_bridge(points(1e-4, 1.0, sizes=(4096, 4096)))
    assert fitted_bridges(points(1e-4, 1.0), "mpi") == {}


def test_fitted_bridge_replaces_the_defaults():
    cluster = two_vendors()
    measured = cm.AnalyticalCostModel(MODEL, cluster, TRAINING)
    measured.measured_bridges = fitted_bridges(points(1e-3, 0.25), "gloo")
    layout = dict(pp=2, dp=2, stage_devices=["nv-small", "amd-big"])
    fitted, default = estimate(cluster, cost_model=measured, **layout), estimate(cluster, **layout)
    h, g = hidden_bytes(), default.num_microbatches
    bridge_default, _ = edge_seconds()
    bridge_fitted = 1e-3 + h / 0.25e9 + 2 * h / (HOST_COPY_GBPS * 1e9)
    assert fitted.predicted_iteration_time_s - default.predicted_iteration_time_s == pytest.approx(
        (g + 1) * (bridge_fitted - bridge_default), rel=1e-6)


def test_a_crossing_never_makes_a_plan_faster():
    rng = np.random.default_rng(7)
    for _ in range(25):
        gbps = float(rng.uniform(0.05, 400))
        nodes = [{"name": "n", "devices": {"nv-small": 2, "amd-big": 2}, "intra_node_gbps": gbps}]
        bridge = {"host_copy_gbps": float(rng.uniform(1, 50))}
        order = list(rng.permutation(["nv-small", "amd-big"]))
        layout = [dict(pp=2, dp=2, stage_devices=order), dict(pp=4, dp=1, stage_devices=[order[0]] * 2 + [order[1]] * 2),
                  dict(pp=1, dp=4, stage_devices=["nv-small+amd-big"]),
                  dict(pp=2, dp=2, stage_devices=order, schedule="interleaved", virtual_stages=2)][rng.integers(4)]
        mbs = int(rng.choice([1, 2, 4]))
        crossing = estimate(two_vendors(nodes=nodes, bridge=bridge), micro_batch_size=mbs, **layout)
        native = estimate(two_vendors(shared_domain=True, nodes=nodes, bridge=bridge), micro_batch_size=mbs, **layout)
        assert crossing.predicted_iteration_time_s >= native.predicted_iteration_time_s


def test_tied_embeddings_across_domains_cost_the_bridge_all_reduce_of_their_gradient():
    """The first and the last stage sum the shared weight's gradient after the backward (the step
    waits for it): over the bridge when the two stages sit on different vendors."""
    import dataclasses

    tied = dataclasses.replace(MODEL, tie_embeddings=True)
    layout = dict(tp=1, micro_batch_size=1, references=(1.0, 1.0, 1.0), pp=2, dp=2,
                  stage_devices=["nv-small", "amd-big"], layers_per_stage=[4, 4])
    crossing = evaluate_layout(tied, two_vendors(), TRAINING, **layout)
    untied = evaluate_layout(MODEL, two_vendors(), TRAINING, **layout)
    m = MODEL.embedding_params * TRAINING.precision_bytes("grad_dtype")
    bridge = 2 * m / (HOST_COPY_GBPS * 1e9) + 2 * BRIDGE_LATENCY_S + m / (BRIDGE_GBPS * 1e9)
    [sum_of_ends] = [c for c in crossing.crossings if c.kind == "tied_embeddings"]
    assert (sum_of_ends.stages, sum_of_ends.domains) == ([0, 1], ["nccl", "rccl"])
    assert sum_of_ends.seconds_per_step == pytest.approx(bridge) and sum_of_ends.bytes_per_step == m
    # the tied model also holds the head's copy on the last stage: only the sum is extra time here
    assert crossing.predicted_iteration_time_s > untied.predicted_iteration_time_s
    native = evaluate_layout(tied, two_vendors(shared_domain=True), TRAINING, **layout)
    assert not [c for c in native.crossings if c.kind == "tied_embeddings"]
    assert crossing.predicted_iteration_time_s - native.predicted_iteration_time_s > bridge - 2 * (
        NATIVE_LATENCY_S + m / (LINK_GBPS * EFFICIENCY * 1e9))
    # Fully sharded, each rank holds its DP shard of the gradient after the reduce-scatter and sums
    # that with its peer's (memx-run's FSDP2: tests/test_adapters.py counts the bytes sent).
    sharded = TrainingSpec(**{**TRAINING.__dict__, "fully_sharded": True})
    [shards] = [c for c in evaluate_layout(tied, two_vendors(), sharded, **layout).crossings
                if c.kind == "tied_embeddings"]
    half = 2 * m / 2 / (HOST_COPY_GBPS * 1e9) + 2 * BRIDGE_LATENCY_S + m / 2 / (BRIDGE_GBPS * 1e9)
    assert shards.bytes_per_step == m / 2 and shards.seconds_per_step == pytest.approx(half)


def test_two_vendor_example_plans_memx_run_s_partitioned_sends_across_the_bridge():
    import os
    cluster = ClusterSpec.from_yaml(os.path.join(os.path.dirname(__file__), "..", "examples", "clusters",
                                                 "h100-mi300x.yaml"))
    assert {d.name: d for d in cluster.device_types}.keys() == {"h100", "mi300x"} and cluster.crosses_domains
    model = get_model("llama2-13b")
    training = TrainingSpec(global_batch_size=256, seq_len=4096, dtype="bf16", setup="memx-run")
    plan = search(model, cluster, training).best
    [edge] = [c for c in plan.crossings if c.kind == "pipeline"]
    assert plan.tp > 1 and set(edge.domains) == {"nccl", "rccl"}
    # Each rank of the first stage sends its TP-th of every hidden state, its peer its TP-th of every
    # gradient: 16-bit from stages memx-run shards (FSDP2 where TP > 1 and DP > 1), else autocast's fp32.
    whole = plan.micro_batch_size * 4096 * model.hidden_size * (2 if plan.dp > 1 else 4)
    assert edge.bytes_per_step == plan.num_microbatches * whole / plan.tp
    assert edge.senders == 2 * plan.tp * plan.dp
