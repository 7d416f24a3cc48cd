"""What memx prints: plan tables, why the winner won, the --compare table, estimates, the
Pareto plot. Text in, text out (the plot is the one file written); no torch import.
"""

from __future__ import annotations


from memx_launch.errors import ConfigError
from memx_launch.files import atomic_output, check_output_path
from memx_launch.planning import experts
from memx_launch.planning.estimate import stage_short_gib
from memx_launch.planning.layouts import MIXED_SEPARATOR, stage_device_types, tp_text
from memx_launch.planning.peaks import datasheet_hbm, hbm_gbps, linear_tflops, matmul_peak_tflops, training_tflops
from memx_launch.planning.plan import Plan
from memx_launch.planning.runtime_support import check_runnable
from memx_launch.planning.memory_parts import MEMORY_PARTS
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec

EMULATION_NOTE = ("EMULATED cluster: devices are CPU processes with a memory guard and a compute "
                  "slowdown, not real GPUs; predictions describe the emulated devices")


def table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    """Aligned plain-text table; columns in ``right`` are right-aligned (numbers)."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells):
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}-{r}" if r != start else f"{r}")
            start = None
    return ",".join(out)


def layout_summary(plan: Plan) -> str:
    sched = plan.schedule if plan.schedule == "1f1b" else f"{plan.schedule} v={plan.virtual_stages}"
    cp = f" cp={plan.cp}" if plan.cp > 1 else ""
    etp = plan.training.get("expert_tensor_parallel", 1)
    ep = (f" ep={plan.training.get('expert_parallel', 1)}" + f" etp={etp}" * (etp > 1)) if plan.model_spec.num_experts \
        else ""
    shard = f" shard={plan.training['shard_degree']}" if plan.training.get("shard_degree") else ""
    return (f"tp={tp_text(plan.stage_tps)} pp={plan.pp}{cp} dp={tp_text(plan.stage_dps)}{shard}{ep} "
            f"mbs={plan.micro_batch_size} seq={plan.seq_len} {sched}")


def header(cluster: ClusterSpec, model: str) -> list[str]:
    counts = ", ".join(f"{n} x {t}" for t, n in cluster.type_counts().items())
    lines = [f"model {model} on {cluster.name}: {cluster.world_size} devices ({counts})"]
    if cluster.is_emulated:
        lines.append(EMULATION_NOTE)
    for t in cluster.device_types:
        if t.clock_share < 1.0:
            counted = ("its given efficiency taken as measured under it" if t.efficiency is not None
                       else f"compute at {t.clock_share:.2f} of the rated clock")
            lines.append(f"{t.name}: power limit {t.power_limit_w:g} of {t.rated_power_w:g} W, {counted}")
    return lines


def rate_lines(cluster: ClusterSpec, training: TrainingSpec, model=None) -> list[str]:
    """The rates the analytical model times each device type at: its matmuls' sustained rate of
    the peak for ``training``'s precision (and its FP8 or FP4 linears', or ``model``'s experts'
    where they run in fp32), and what memory-bound work moves of its datasheet bandwidth. None on
    an emulated cluster, whose stand-ins are timed by what calibration measured of them."""
    if cluster.is_emulated:
        return []
    parts = []
    fp32_experts = bool(model is not None and model.num_experts and experts.fp32_experts(training))
    for t in cluster.device_types:
        quantized = (f" ({linear_tflops(t, training):,.0f} in its {'FP8' if training.fp8 else 'FP4'} linears)"
                     if training.quantized_linears else "")
        if fp32_experts:  # Transformers' grouped GEMMs under autocast (planning/experts.py)
            quantized = (f" ({experts.grouped_gemm_rate(t, training)[0]:,.0f} in its experts' fp32 GEMMs: "
                         "Transformers casts their input to the fp32 weights; 16-bit weights run them at 16 bits)")
        parts.append(f"{t.name} matmuls {training_tflops(t, training):,.0f} of {matmul_peak_tflops(t, training):,.0f} "
                     f"TFLOPS{quantized}, memory {hbm_gbps(t):,.0f} of {datasheet_hbm(t):,.0f} GB/s")
    return ["rates (analytical): " + "; ".join(parts)]


def format_gib(gib: float) -> str:
    """GiB, or MiB below one GiB (emulated devices hold megabytes)."""
    return f"{gib:.1f} GiB" if abs(gib) >= 1 else f"{gib * 1024:.1f} MiB"


def stage_rows(plan: Plan) -> list[list[str]]:
    rows = []
    for i, s in enumerate(plan.stages):
        cap = s.memory_capacity_gib
        if cap:
            margin = cap - s.predicted_peak_memory_gib
            fits = "fits" if margin >= 0 else f"OOM by {format_gib(-margin)}"
            mem = (f"{format_gib(s.predicted_peak_memory_gib)} / {format_gib(cap)} "
                   f"({s.predicted_peak_memory_gib / cap:.0%})")
        else:
            fits, mem = "?", format_gib(s.predicted_peak_memory_gib)
        rows.append([str(i), s.device_type, rank_ranges(s.ranks), str(s.num_layers), s.recompute,
                     mem, fits, f"{s.predicted_stage_time_s * 1e3:.1f}"])
    return rows


STAGE_HEADERS = ["stage", "device", "ranks", "layers", "recompute", "memory (peak / capacity)",
                 "verdict", "stage ms"]


def stage_table(plan: Plan) -> str:
    if plan.stage_tp is None:
        return table(STAGE_HEADERS, stage_rows(plan), right={0, 3, 7})
    # Stages of different TP degrees: each stage's degree after its device.
    rows = [row[:2] + [str(t)] + row[2:] for row, t in zip(stage_rows(plan), plan.stage_tp)]
    return table(STAGE_HEADERS[:2] + ["tp"] + STAGE_HEADERS[2:], rows, right={0, 2, 4, 8})


def plans_table(plans: list[Plan]) -> str:
    """One line per ranked plan."""
    rows = []
    for k, p in enumerate(plans, 1):
        rows.append([str(k), f"{p.objective.phi:.3f}", f"{p.predicted_iteration_time_s:.2f}",
                     f"{p.predicted_peak_memory_fraction:.0%}", f"{p.predicted_memory_variance:.3g}",
                     layout_summary(p),
                     ":".join(str(s.num_layers) for s in p.stages),
                     ",".join(_short_level(s.recompute) for s in p.stages)])
    return table(["#", "phi", "iter s", "peak mem", "mem var", "layout", "layers", "recompute"],
                 rows, right={0, 1, 2, 3, 4})


def _short_level(level: str) -> str:
    return {"none": "-", "selective": "sel", "full": "full"}.get(level, level)


def why_line(plan: Plan, reason: str = "") -> str:
    """The winner's Phi as the product of its three normalised terms."""
    o = plan.objective
    w_t, w_m, w_v = o.weights
    t, m, v = (o.terms.get(k, float("nan")) for k in ("T", "M", "V"))
    line = (f"why it won: phi={o.phi:.3f} = T {t:.3f}^{w_t:.2f} x M {m:.3f}^{w_m:.2f} x V {v:.3f}^{w_v:.2f} "
            f"(terms relative to the medians of the feasible candidates); profile '{o.profile}' "
            f"(wT,wM,wV = {w_t:.2f},{w_m:.2f},{w_v:.2f})")
    return line + (f": {reason}" if reason else "")


def trade_text(plan: Plan, fastest: Plan) -> str:
    """'+4% time for -31% peak memory, -80% memory variance' (time per token, so plans of
    different sequence lengths compare)."""
    def time_per_token(p):
        return p.predicted_iteration_time_s / p.seq_len

    def change(new, old):
        return f"{new / old - 1:+.0%}" if old else ("+0%" if new == old else "from 0")

    return (f"{change(time_per_token(plan), time_per_token(fastest))} time for "
            f"{change(plan.predicted_peak_memory_fraction, fastest.predicted_peak_memory_fraction)} peak memory, "
            f"{change(plan.predicted_memory_variance, fastest.predicted_memory_variance)} memory variance")


def trade_line(best: Plan, fastest: Plan, max_slowdown: float | None) -> str:
    """What the winner costs and buys against the fastest feasible plan."""
    bound = ("no bound: --objective or --weights without --max-slowdown" if max_slowdown is None
             else f"--max-slowdown {max_slowdown:.0%}")
    if best is fastest:
        return f"the winner is the fastest feasible plan ({bound})"
    return (f"against the fastest feasible plan ({layout_summary(fastest)}, "
            f"{fastest.predicted_iteration_time_s:.2f} s): {trade_text(best, fastest)} ({bound})")


def plan_report(result, cluster: ClusterSpec, rates=()) -> str:
    """``memx plan`` output: the ranked plans, the winner's stages, why it won (at which ``rates``:
    :func:`rate_lines`)."""
    best = result.plans[0]
    lines = header(cluster, best.model) + list(rates)
    lines += ["", f"top {len(result.plans)} plans (lower phi is better):", plans_table(result.plans), "",
              f"winner: {layout_summary(best)}, predicted iteration {best.predicted_iteration_time_s:.2f} s, "
              f"{best.num_microbatches} micro-batches",
              stage_table(best), *split_send_lines(best), *crossing_lines(best, cluster), "",
              why_line(best, result.reason),
              trade_line(best, result.fastest, result.max_slowdown)]
    if result.unbounded is not best:
        lines.append(f"without --max-slowdown's bound the profile would pick {layout_summary(result.unbounded)}: "
                     + trade_text(result.unbounded, result.fastest))
    if best.pp > 1 and best.training.get("fully_sharded") and best.training.get("max_live_params"):
        lines.append("note: DeepSpeed's pipeline engine refuses ZeRO-3: this plan prices DeepSpeed's fetching in "
                     "stages another framework must pipeline; a DeepSpeed run is one stage (--pp 1, on devices of "
                     "one type)")
    experts = best.training.get("expert_parallel", 1) * best.training.get("expert_tensor_parallel", 1)
    if experts > 1 and best.training.get("fully_sharded") and best.training.get("max_live_params"):
        lines.append(f"note: DeepSpeed's MoE layers refuse ZeRO-3: this plan prices DeepSpeed's fetching with the "
                     f"experts split over {experts} ranks, which no DeepSpeed run does; a Hugging Face mixture "
                     "under ZeRO-3 keeps every expert whole (--expert-parallel 1)")
    if result.stats.pruned_too_few_microbatches:
        lines.append(f"left out: {result.stats.pruned_too_few_microbatches} candidates with fewer micro-batches "
                     "than stages (memx-run's pipeline schedule needs one per stage)")
    return "\n".join(lines)


def split_send_lines(plan: Plan) -> list[str]:
    """The pipeline edges whose sends go in TP parts (the stages' ``send_parts``), if any."""
    edges = range(plan.pp if plan.schedule == "interleaved" else plan.pp - 1)  # the last: the wrap-around
    split = [f"{i} -> {(i + 1) % plan.pp}" for i in edges if plan.stages[i].send_parts > 1]
    return [f"pipeline sends in TP parts (a TP-th from each rank, all-gathered on receipt) over edges {', '.join(split)}; "
            "the other edges whole"] if split else []


def crossing_lines(plan: Plan, cluster: ClusterSpec) -> list[str]:
    """The plan's traffic between communication domains: each crossing pipeline edge and DP
    group, its bytes and seconds per step (why plans keep a vendor's stages together)."""
    if not plan.crossings:
        return []
    lines = [f"crossing communication domains over the bridge ({cluster.bridge.backend}, staged through host memory):"]
    for c in plan.crossings:
        states = "" if c.shard_ranks is None else ", its states whole" if c.shard_ranks == 1 else \
            f", sharded within each domain over {c.shard_ranks} ranks"
        senders = "per rank" if c.senders is None else f"from each of {c.senders} ranks"
        lines.append(f"  {c.what} ({' | '.join(c.domains)}){states}: "
                     f"{format_gib(c.bytes_per_step / 2**30)} sent {senders}, {c.seconds_per_step:.3g} s per step")
    # What carries them is memx-run: another setup's plan prices them as that framework would send them.
    priced = "" if plan.training.get("setup") == "memx-run" else "; --setup memx-run prices them as it sends them"
    lines.append("  only memx-run carries these: Megatron-LM, torchtitan and DeepSpeed run each group on one "
                 f"collective library (memx export refuses this plan){priced}")
    try:
        check_runnable(plan)
    except ConfigError as refusal:
        lines.append(f"  and memx-run cannot run it ({refusal.problem}): no framework runs this plan; plan on one "
                     "communication domain's devices")
    return lines


def search_stats_line(stats) -> str:
    s = stats
    cut = " (time budget reached: search cut short)" if s.budget_exhausted else ""
    return (f"search: {s.enumerated} configurations enumerated, {s.evaluated} evaluated, {s.feasible} feasible, "
            f"pruned {s.pruned_memory} by memory, {s.pruned_time} by time, "
            f"{s.pruned_schedule + s.pruned_batch} by schedule/batch; cache {s.cache_hits} hits / "
            f"{s.cache_misses} misses; {s.seconds:.2f} s{cut}")


def compare_table(baselines: dict[str, Plan | None]) -> str:
    """The same cost model's verdict on what other planners would pick."""
    rows = []
    for name, p in baselines.items():
        if p is None:
            rows.append([name, "-", "-", "-", "-", "no layout", ""])
            continue
        over = [s.predicted_peak_memory_gib - s.memory_capacity_gib for s in p.stages
                if s.memory_capacity_gib and s.predicted_peak_memory_gib > s.memory_capacity_gib]
        oom = f"yes, {format_gib(max(over))} over" if over else "no"
        rows.append([name, f"{p.predicted_iteration_time_s:.2f}", f"{p.predicted_peak_memory_fraction:.0%}",
                     f"{p.predicted_memory_variance:.3g}", oom,
                     ":".join(str(s.num_layers) for s in p.stages),
                     layout_summary(p) + " " + ",".join(_short_level(s.recompute) for s in p.stages)])
    return table(["strategy", "iter s", "peak mem", "mem var", "OOM", "layers", "layout, recompute"],
                 rows, right={1, 2, 3})


def estimate_report(plan: Plan, cluster: ClusterSpec, memory_headroom: float = 0.0, split_note: str = "",
                    host_bound=(), rates=()) -> str:
    """``memx estimate``: will it fit (under each capacity less ``memory_headroom``), how long
    does it take (and which stages' layers the host sets, ``host_bound``:
    :func:`~memx_launch.planning.estimate.host_bound_stages`; at which ``rates``:
    :func:`rate_lines`), what is its Phi."""
    lines = header(cluster, plan.model) + list(rates)
    short = [(i, gib) for i, gib in enumerate(stage_short_gib(plan, memory_headroom)) if gib > 0]
    limit = "its capacity" + (f" less {memory_headroom:.0%} headroom" if memory_headroom else "")
    verdict = (f"fits: every stage is under {limit}" if not short else
               "OOM: " + ", ".join(f"stage {i} short {format_gib(gib)} per device" for i, gib in short)
               + (f" (against {limit})" if memory_headroom else ""))
    o = plan.objective
    pipeline = (f", fewer micro-batches than stages ({plan.num_microbatches} < {plan.pp}): the pipeline "
                "never fills" if plan.num_microbatches < plan.pp else "")
    lines += ["", f"layout: {layout_summary(plan)}, {plan.num_microbatches} micro-batches{pipeline}"
              + (f"; {split_note}" if split_note else ""),
              stage_table(plan), *_mixed_stage_notes(plan, cluster), *split_send_lines(plan),
              *crossing_lines(plan, cluster),
              *host_bound_lines(plan, host_bound), *memory_parts_lines(plan), "",
              f"predicted iteration time: {plan.predicted_iteration_time_s:.3f} s; peak memory "
              f"{plan.predicted_peak_memory_fraction:.0%} of capacity; memory variance "
              f"{plan.predicted_memory_variance:.3g} GiB^2",
              f"phi={o.phi:.3f} (T {o.terms.get('T', float('nan')):.3f}, M {o.terms.get('M', float('nan')):.3f}, "
              f"V {o.terms.get('V', float('nan')):.3f}; weights {','.join(f'{w:.2f}' for w in o.weights)})",
              verdict]
    return "\n".join(lines)


def host_bound_lines(plan: Plan, host_bound) -> list[str]:
    """One line per stage (and device type) whose layers the host issues slower than the device
    runs them, with what shortens the host's share."""
    num_experts, eager = plan.model_spec.num_experts, plan.training.get("eager_block")
    local = num_experts / plan.training.get("expert_parallel", 1) if num_experts else 0
    why = [f"its MoE layer's ops grow with its {local:g} local experts"] * bool(num_experts) \
        + ["its block runs as eager ops"] * bool(eager)
    shorter = ["a larger micro-batch"] + ["more expert parallelism"] * bool(num_experts) \
        + ["fused kernels (torch.compile, Transformer Engine)"] * bool(eager) + ["CUDA graphs (not modelled)"]
    cause = " and ".join(why) + ": " * bool(why) + ", ".join(shorter[:-1]) + " or " + shorter[-1]
    return [f"host bound: stage {b.stage} ({b.device_type}): {b.layers} of its {plan.stages[b.stage].num_layers} "
            f"layers take the host {b.host_s * 1e3:.1f} ms each to issue, the device {b.device_s * 1e3:.1f} ms to run; "
            f"{cause} would shorten what the host adds" for b in host_bound]


# Short headers of the parts of a stage's peak (StagePlan.memory_parts_gib), in MEMORY_PARTS order.
_PART_HEADERS = {"parameters": "params", "gradients": "grads", "optimizer_states": "optimizer",
                 "optimizer_step": "step", "backward_end": "end", "activations": "activations", "logits_loss": "logits",
                 "pipeline_buffers": "pipeline", "communicator_buffers": "comm", "fixed_overhead": "fixed"}


def memory_parts_lines(plan: Plan) -> list[str]:
    """Each stage's predicted peak by part, per device (what to hold against
    torch.cuda.memory_allocated and memory_reserved); nothing where the plan has no parts."""
    if any(s.memory_parts_gib is None for s in plan.stages):
        return []
    rows = [[f"stage {i}"] + [format_gib(s.memory_parts_gib[name]) if s.memory_parts_gib.get(name) else "-"
                        for name in MEMORY_PARTS]
            + [format_gib(s.predicted_peak_memory_gib)] for i, s in enumerate(plan.stages)]
    # "stage i" labels: rows that start with a bare number belong to the stage table above.
    headers = [""] + [_PART_HEADERS[name] for name in MEMORY_PARTS] + ["= peak"]
    return ["", "memory by part, per device:", table(headers, rows, right=set(range(1, len(headers))))]


def _mixed_stage_notes(plan: Plan, cluster: ClusterSpec) -> list[str]:
    """Which device type a stage spread over several types is shown on."""
    known = {d.name: d for d in cluster.device_types}
    notes = []
    for i, s in enumerate(plan.stages):
        if s.device_type in known or MIXED_SEPARATOR not in s.device_type:
            continue
        types = stage_device_types(s.device_type)
        shown = [t for t in types if t in known and abs(known[t].memory_gib - s.memory_capacity_gib) < 1e-9]
        notes.append(f"stage {i}: replicas on {', '.join(types)}; memory shown on {' or '.join(shown) or '?'} "
                     "(nearest its capacity; the stage must fit on every type), time of the slowest type")
    return notes


def pareto_plot(result, path: str, overwrite: bool = False, emulated: bool = False) -> None:
    """Iteration time against memory variance: ranked plans, the Pareto front, the winner."""
    check_output_path(path, "--plot", overwrite)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ranked = result.plans
    ax.scatter([p.predicted_iteration_time_s for p in ranked], [p.predicted_memory_variance for p in ranked],
               s=18, color="0.6", label=f"top {len(ranked)} by phi")
    front = sorted(result.pareto, key=lambda p: p.predicted_iteration_time_s)
    ax.plot([p.predicted_iteration_time_s for p in front], [p.predicted_memory_variance for p in front],
            "o-", color="tab:blue", ms=4, label="Pareto front")
    best = ranked[0]
    ax.scatter([best.predicted_iteration_time_s], [best.predicted_memory_variance], s=140, marker="*",
               color="tab:red", zorder=3, label=f"winner ({layout_summary(best)})")
    ax.set_xlabel("predicted iteration time (s)")
    ax.set_ylabel("variance of per-device memory (GiB^2)")
    title = f"{best.model} on {best.cluster}" + (" (emulated)" if emulated else "")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png_atomic(fig, path)


def save_png_atomic(fig, path: str, dpi: int = 120) -> None:
    """Write a matplotlib figure to ``path`` through a temporary file and a rename, then close it."""
    import matplotlib.pyplot as plt

    try:
        with atomic_output(path, "--plot", overwrite=True, suffix=".png") as tmp:
            fig.savefig(tmp, format="png", dpi=dpi)
    finally:
        plt.close(fig)
