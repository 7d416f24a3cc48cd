"""One job across communication domains, emulated on CPU: two "vendors" whose native groups are
separate gloo groups, everything between them over the bridge, strict mode on (a native group
spanning domains, or a device tensor on the bridge unstaged, fails the job). Every case matches
the single-process reference, and nothing any rank receives is unpickled (the stages' shape
metadata travels as JSON)."""

import dataclasses
import os

import pytest
import torch

from memx_launch.planning.estimate import evaluate_layout
from memx_launch.runtime.communication import DomainViolation
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec
from memx_launch.specs.cluster import ClusterSpec, Emulation
from ranks import spawn_ranks
from memx_launch.planning.plan import Objective, Plan, StagePlan
from test_runtime import GRAD_ATOL, LOSS_ATOL, SPEC, _batch, _reference, make_plan

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "cpu-two-vendors.yaml")


def _cluster(order: list[str], per_node: int = 1, intra_node_gbps: float = 2.0, example: str = EXAMPLE) -> ClusterSpec:
    """``example``'s types (cpu-two-vendors') with room for any test plan (1 GiB), ``per_node``
    devices of one type on each node, in ``order`` (ranks in that order)."""
    base = ClusterSpec.from_yaml(example)
    types = tuple(dataclasses.replace(t, memory_gib=1.0) for t in base.device_types)
    return ClusterSpec(base.name, types, tuple(  # no slowdown: these cases check numbers, not speed
        type(base.nodes[0])(f"n{i}", ((order[i * per_node], per_node),), intra_node_gbps)
        for i in range(len(order) // per_node)), 2.0, Emulation(()))


ALTERNATING = ["nv-small", "amd-big", "nv-small", "amd-big"]
MIXED = "nv-small+amd-big"


def _count_unpickling() -> list:
    """Every unpickling in this process from now on: pickle.loads and the Unpickler torch's
    object collectives use."""
    import pickle

    import torch.distributed.distributed_c10d as c10d

    seen = []
    loads, unpickler = pickle.loads, c10d._unpickler
    pickle.loads = lambda *a, **k: seen.append("pickle.loads") or loads(*a, **k)
    c10d._unpickler = lambda *a, **k: seen.append("object collective") or unpickler(*a, **k)
    return seen


def _worker(rank, port, cases, queue):
    import torch.distributed as dist

    from memx_launch.runtime.communication import init_distributed
    from memx_launch.profiling.emulation import device_for_rank
    from memx_launch.runtime.training import Runtime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(cases[0][1].world_size),
                      MEMX_STRICT_DOMAINS="1")
    torch.set_num_threads(1)
    results = []
    unpickled = _count_unpickling()
    try:
        for generation, (plan, cluster, steps, max_grad_norm) in enumerate(cases):
            os.environ["MEMX_GENERATION"] = str(generation)  # a fresh key prefix per process group
            init_distributed(plan, cluster)
            runtime = Runtime(plan, rank, emulated=device_for_rank(cluster, rank), cluster=cluster, lr=1e-2,
                              max_grad_norm=max_grad_norm)
            tokens, targets = _batch(plan)
            stats = [runtime.step(runtime.local_batch(tokens), runtime.local_batch(targets))]
            grads = {}  # the first step's, as the reference computes them
            for module in runtime.chunks:
                for name, p in module.named_parameters():
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    grads[name.removeprefix("module.")] = g.numpy()
            stats += [runtime.step(runtime.local_batch(tokens), runtime.local_batch(targets))
                      for _ in range(steps - 1)]
            mesh = () if runtime.dp_mesh is None else tuple(runtime.dp_mesh.shape)  # FSDP2's over the DP replicas
            results.append(([s.loss for s in stats], stats[0].bridge_messages, stats[0].bridge_bytes, grads,
                            list(unpickled), runtime.emulated.collective_check is not None, mesh))
            dist.destroy_process_group()
    finally:
        queue.put((rank, results))


TWO_VENDORS = _cluster(["nv-small", "nv-small", "amd-big", "amd-big"])  # as in the example: nccl, nccl, rccl, rccl
CASES = {
    "1f1b pp=4 across domains, uneven 3/1/2/2, full:2 on the first stage":
        (make_plan([((0,), 3, "full:2"), ((1,), 1, "none"), ((2,), 2, "selective"), ((3,), 2, "none")],
                   micro_batch_size=2, global_batch_size=8, device_type="nv-small"), TWO_VENDORS),
    "interleaved v=2 pp=4 across domains (the last stage feeds the first over the bridge)":
        (make_plan([((0,), 2, "full"), ((1,), 2, "selective"), ((2,), 2, "none"), ((3,), 2, "full")],
                   global_batch_size=4, schedule="interleaved", virtual_stages=2, device_type="nv-small"),
         TWO_VENDORS),
    "DP replicas span domains (mixed stages), pipelines inside each domain":
        (make_plan([((0, 1), 5, "selective"), ((2, 3), 3, "none")], dp=2, micro_batch_size=2,
                   global_batch_size=8, device_type=MIXED), _cluster(ALTERNATING)),
    "DP replicas and pipelines both cross domains":
        (make_plan([((0, 1), 4, "none"), ((2, 3), 4, "full")], dp=2, micro_batch_size=1, global_batch_size=4,
                   device_type=MIXED), _cluster(["nv-small", "amd-big", "amd-big", "nv-small"])),
    "tp=2 inside each domain x pp=2 across, each TP rank sending its half of every boundary tensor":
        (make_plan([((0, 1), 6, "selective"), ((2, 3), 2, "none")], tp=2, global_batch_size=4,
                   device_type="nv-small", send_parts=2), TWO_VENDORS),
    "interleaved v=2, tp=2 x pp=2 across, partitioned both ways (the wrap-around edge too)":
        (make_plan([((0, 1), 5, "none"), ((2, 3), 3, "full")], tp=2, global_batch_size=4, schedule="interleaved",
                   virtual_stages=2, device_type="nv-small", send_parts=2), TWO_VENDORS),
    "fully sharded DP replicas across domains: FSDP2 within each domain, the shards averaged over the bridge":
        (make_plan([((0, 1, 2, 3), 8, "selective")], dp=4, micro_batch_size=1, global_batch_size=8,
                   device_type=MIXED, training={"fully_sharded": True, "hold_gathered": "always"}), TWO_VENDORS),
}


def _matches_reference(name, rank, losses, grads, ref_loss, ref_grads) -> set:
    """A rank's first loss and gradients against the one-process reference, and its loss falling
    at the second step (the optimizer stepped on synced gradients); the parameters it holds."""
    assert abs(losses[0] - ref_loss) < LOSS_ATOL, (name, rank, losses[0], ref_loss)
    assert losses[1] < losses[0], (name, rank)
    for param, grad in grads.items():
        diff = (torch.from_numpy(grad) - ref_grads[param]).abs().max().item()
        assert diff < GRAD_ATOL, (name, rank, param, diff)
    return set(grads)


def _pipeline_bytes(plan) -> int:
    """What each rank of a pipeline through two domains sends over the bridge in a step: each fp32
    hidden state once each way, over the edge v times and the wrap-around v - 1 times a micro-batch."""
    boundary = plan.micro_batch_size * plan.seq_len * SPEC.hidden_size * 4
    return 2 * (2 * plan.virtual_stages - 1) * plan.num_microbatches * boundary


@pytest.mark.slow
def test_cross_domain_plans_match_the_single_process_reference():
    cases = [(plan, cluster, 2, None) for plan, cluster in CASES.values()]
    results = spawn_ranks(_worker, 4, cases, timeout=300)
    for i, (name, (plan, _)) in enumerate(CASES.items()):
        ref_loss, ref_grads = _reference(plan)
        covered = set()
        crossed = 0
        for rank in range(4):
            losses, messages, nbytes, grads, unpickled, bridge_checked, mesh = results[rank][i]
            # Sharded within each vendor's two ranks where the plan is fully sharded, else no FSDP2 across domains.
            assert mesh == ((2,) if plan.training.get("fully_sharded") else ()), (name, rank, mesh)
            assert unpickled == [], (name, rank, unpickled)
            assert bridge_checked, (name, rank)  # strict mode (the emulated default) checks inside the device
            covered |= _matches_reference(name, rank, losses, grads, ref_loss, ref_grads)
            crossed += messages
            if plan.stages[0].send_parts > 1:  # each TP rank sends its 1/TP of each tensor (whole: x TP)
                assert nbytes == _pipeline_bytes(plan), (name, nbytes)
        assert covered == set(ref_grads), name
        assert crossed > 0, f"{name}: nothing took the bridge"


def _scored(cluster, training: dict, **layout) -> Plan:
    """memx estimate's plan of a layout of llama-tiny on ``cluster``, its crossings counted (its
    stages on ranks in order, as the worker runs them)."""
    spec = TrainingSpec(**{"global_batch_size": 4, "seq_len": 32, "dtype": "fp32", "setup": "memx-run", **training})
    return evaluate_layout(get_model("llama-tiny"), cluster, spec, micro_batch_size=1, references=(1.0, 1.0, 1.0),
                           **layout)


PAIRED = _cluster(["nv-small", "nv-small", "amd-big", "amd-big"], per_node=2, intra_node_gbps=100.0)
PLANNED_BYTES = {
    "pipeline across at TP 2, partitioned: each vendor's pair on one node, its link faster than the bridge": (
        _scored(PAIRED, {"seq_len": 128}, tp=2, pp=2, dp=1, stage_devices=["nv-small", "amd-big"]), PAIRED),
    "pipeline across at TP 2, whole: the pairs' link no faster than the bridge": (
        _scored(TWO_VENDORS, {}, tp=2, pp=2, dp=1, stage_devices=["nv-small", "amd-big"]), TWO_VENDORS),
    "DP replicas across vendors, pipelines inside each": (
        _scored(_cluster(ALTERNATING), {"global_batch_size": 8}, tp=1, pp=2, dp=2,
                stage_devices=[MIXED, MIXED]), _cluster(ALTERNATING)),
    "fully sharded within each vendor, the shards summed over the bridge": (
        _scored(TWO_VENDORS, {"global_batch_size": 8, "fully_sharded": True}, tp=1, pp=1, dp=4,
                stage_devices=[MIXED]), TWO_VENDORS),
    "TP 1 | 1 | 2, the edge between vendors and TP degrees sent once and broadcast": (
        _scored(TWO_VENDORS, {}, tp=None, stage_tp=[1, 1, 2], pp=3, dp=1,
                stage_devices=["nv-small", "nv-small", "amd-big"]), TWO_VENDORS),
    "bf16, each vendor's stage fully sharded, the pipeline across: FSDP2's 16-bit hidden states": (
        _scored(TWO_VENDORS, {"global_batch_size": 8, "fully_sharded": True, "dtype": "bf16"}, tp=1, pp=2, dp=2,
                stage_devices=["nv-small", "amd-big"]), TWO_VENDORS),
    "bf16 autocast at TP 2, partitioned across: parts of its fp32 hidden states": (
        _scored(PAIRED, {"seq_len": 128, "dtype": "bf16"}, tp=2, pp=2, dp=1, stage_devices=["nv-small", "amd-big"]),
        PAIRED),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", PLANNED_BYTES)
def test_every_byte_that_crosses_vendors_is_the_plans(name):
    # What the ranks send over the bridge in a step is what the plan's crossings count: a pipeline
    # edge's parts, or its whole tensors once per rank pair, a DP group's hierarchical sum, a shard's.
    # One job per case: several jobs' TP and FSDP2 meshes in one process do not all rebuild.
    plan, cluster = PLANNED_BYTES[name]
    assert all(s.ranks == sorted(s.ranks) for s in plan.stages) and plan.stages[0].ranks[0] == 0
    planned = plan.bridge_bytes_per_step
    assert planned, plan.crossings
    results = spawn_ranks(_worker, 4, [(plan, cluster, 1, None)], timeout=300)
    for rank in range(plan.world_size):
        sent = results[rank][0][2]  # the job's, as every rank sees it
        assert sent == pytest.approx(planned, rel=1e-3), (rank, sent, planned, plan.crossings)


def _communicator_worker(rank, port, queue):
    import torch.distributed as dist

    from memx_launch.runtime.communication import Communicator
    from memx_launch.profiling.emulation import EmulatedDevice

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    emulated = EmulatedDevice("dev", memory_gib=1.0)
    comm = Communicator(["nccl", "nccl", "rccl", "rccl"], torch.device("cpu"), strict=True, emulated=emulated)
    out = {}
    try:
        comm.prepare_all_reduce(range(4))  # every rank makes every group, in one order
        comm.prepare_all_reduce(range(3))
        bridge = comm.bridge([1, 2])
        value = torch.arange(5, dtype=torch.float64) + 10 * rank
        comm.all_reduce_sum(value, range(4))  # two domains of two: sharded
        out["sharded"] = value.tolist()
        if rank < 3:  # domains of two and one: the leaders sum across
            value = torch.arange(3, dtype=torch.float64) + 10 * rank
            comm.all_reduce_sum(value, range(3))
            out["leaders"] = value.tolist()
        try:
            comm.native([1, 2])
        except DomainViolation as exc:
            out["native"] = str(exc)
        if rank in (1, 2):
            with emulated:
                on_device = torch.ones(4)  # the guard counts it: device memory
            with emulated, comm.strict_check():
                try:
                    dist.all_reduce(on_device, group=bridge)
                except DomainViolation as exc:
                    out["unstaged"] = str(exc)
            emulated.collective_check = comm.strict_check().check  # as the Runtime checks on an emulated device
            with emulated:
                try:
                    dist.all_reduce(on_device, group=bridge)
                except DomainViolation as exc:
                    out["unstaged in the device's mode"] = str(exc)
                staged = comm.stage(on_device)
                dist.all_reduce(staged, group=bridge)
                out["staged"] = staged.tolist()
    finally:
        queue.put((rank, out))
        dist.destroy_process_group()


def test_communicator_sums_across_domains_and_strict_mode_refuses_what_would_break_on_gpus():
    results = spawn_ranks(_communicator_worker, 4, timeout=120)
    sharded = [sum(i + 10 * r for r in range(4)) for i in range(5)]
    assert all(results[r]["sharded"] == sharded for r in range(4))
    leaders = [sum(i + 10 * r for r in range(3)) for i in range(3)]
    assert all(results[r]["leaders"] == leaders for r in range(3))
    assert all("native group [1, 2] spans domains ['nccl', 'rccl']" in results[r]["native"] for r in range(4))
    for r in (1, 2):
        assert "device tensor (4,) over the bridge unstaged" in results[r]["unstaged"]
        assert "device tensor (4,) over the bridge unstaged" in results[r]["unstaged in the device's mode"]
        assert results[r]["staged"] == [2.0] * 4




def _stage_tp_plan(stages, stage_tp, micro_batch_size=1, global_batch_size=4, schedule="1f1b", virtual_stages=1,
                   training=None):
    """A plan like make_plan's with one TP degree per stage."""
    plan = Plan("llama-tiny", SPEC, "test", None, len(stages), 1, micro_batch_size, global_batch_size, 32, schedule,
                virtual_stages, [StagePlan("nv-small", list(ranks), layers, recompute, 0.0, 0.0)
                                 for ranks, layers, recompute in stages],
                0.0, Objective(1.0, "default", (0.4, 0.2, 0.4)), stage_tp=stage_tp, training=dict(training or {}))
    plan.validate()
    return plan


PER_STAGE_TP = {
    "tp 2|1 in one domain, 1f1b, gradients clipped": (
        _stage_tp_plan([((0, 1), 5, "selective"), ((2,), 3, "none")], [2, 1], micro_batch_size=2,
                       global_batch_size=4), _cluster(["nv-small"] * 3), 0.5),
    "tp 1|2 across domains, interleaved, each edge between TP degrees sent whole, once a pair": (
        _stage_tp_plan([((0,), 4, "none"), ((1, 2), 4, "full")], [1, 2], global_batch_size=4,
                       schedule="interleaved", virtual_stages=2),
        _cluster(["nv-small", "amd-big", "amd-big"]), None),
}


@pytest.mark.slow
def test_stages_of_different_tp_degrees_match_the_reference():
    cases = [(plan, cluster, 2, clip) for plan, cluster, clip in PER_STAGE_TP.values()]
    results = spawn_ranks(_worker, 3, cases, timeout=300)
    for i, (name, (plan, cluster, clip)) in enumerate(PER_STAGE_TP.items()):
        ref_loss, ref_grads = _reference(plan)
        if clip is not None:
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())).item()
            ref_grads = {k: g * min(1.0, clip / (norm + 1e-6)) for k, g in ref_grads.items()}
        covered = set()
        for rank in range(3):
            losses, messages, nbytes, grads, unpickled, _, _ = results[rank][i]
            assert unpickled == [], (name, rank, unpickled)
            covered |= _matches_reference(name, rank, losses, grads, ref_loss, ref_grads)
            assert (messages > 0) == cluster.crosses_domains, name
            if cluster.crosses_domains:  # each tensor crosses once each way, never once per receiver
                assert nbytes == _pipeline_bytes(plan), (name, nbytes)
        assert covered == set(ref_grads), name


THREE = _cluster(["nv-small", "amd-big", "intel-mid", "intel-mid"],
                 example=os.path.join(os.path.dirname(EXAMPLE), "cpu-three-vendors.yaml"))  # nccl, rccl, xccl
NV_AMD, INTEL = "nv-small+amd-big", "intel-mid"
THREE_DOMAINS = {
    "pp 4 through three domains, 1f1b": (
        _scored(THREE, {}, tp=1, pp=4, dp=1, stage_devices=["nv-small", "amd-big", INTEL, INTEL])),
    "interleaved v=2, the wrap-around from the third domain back to the first": (
        _scored(THREE, {}, tp=1, pp=4, dp=1, stage_devices=["nv-small", "amd-big", INTEL, INTEL],
                schedule="interleaved", virtual_stages=2)),
    "dp 4 over domains of 1, 1 and 2 ranks": (
        _scored(THREE, {"global_batch_size": 8}, tp=1, pp=1, dp=4, stage_devices=["nv-small*1+amd-big*1+intel-mid*2"])),
    "pp 2 x dp 2: the first stage's replicas on two domains, both sending to the third": (
        _scored(THREE, {"global_batch_size": 8}, tp=1, pp=2, dp=2, stage_devices=[NV_AMD, INTEL])),
}


@pytest.mark.slow
def test_three_domains_train_as_the_reference_and_send_what_the_plan_counts():
    # A cluster of three vendors (three collective libraries): every crossing is between two of
    # them or, in a DP sum, among all three, and each is carried over the bridge as priced.
    cases = [(plan, THREE, 2, None) for plan in THREE_DOMAINS.values()]
    results = spawn_ranks(_worker, 4, cases, timeout=300)
    for i, (name, plan) in enumerate(THREE_DOMAINS.items()):
        assert len({d for c in plan.crossings for d in c.domains}) == 3, (name, plan.crossings)
        ref_loss, ref_grads = _reference(plan)
        covered = set()
        for rank in range(4):
            losses, messages, nbytes, grads, unpickled, bridge_checked, _ = results[rank][i]
            assert unpickled == [] and bridge_checked, (name, rank, unpickled)
            covered |= _matches_reference(name, rank, losses, grads, ref_loss, ref_grads)
            assert nbytes == pytest.approx(plan.bridge_bytes_per_step, rel=1e-3), (name, rank, nbytes, plan.crossings)
        assert covered == set(ref_grads), name  # every parameter lives on some rank
