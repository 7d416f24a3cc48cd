"""A scored row of a layout group as the Plan memx writes: its training as it was priced (the
degrees the search chose, the stages the layout runs fully sharded), its stages' predictions and
what it sends between communication domains. No torch import.
"""

from __future__ import annotations

import dataclasses

from memx_launch.planning import costmodel as cm
from memx_launch.planning.crossings import crossings_of
from memx_launch.planning.group_result import GroupResult
from memx_launch.planning.layout_training import layout_training
from memx_launch.planning.layouts import stage_device_text
from memx_launch.planning.plan import Objective, Plan, StagePlan


def to_plan(result: GroupResult, row: int, model, cluster, training, objective: Objective) -> Plan:
    lay = result.layout
    chose = (*result.experts, result.shard_degree)  # degrees the search chose
    if chose != (training.expert_parallel, training.expert_tensor_parallel, training.shard_degree):
        training = dataclasses.replace(training, expert_parallel=chose[0], expert_tensor_parallel=chose[1],
                                       shard_degree=chose[2])
    training = layout_training(training, lay)  # the plan records what it was priced as
    stages = [StagePlan(device_type=stage_device_text(cluster, ranks, int(lay.stage_tp[i]) * lay.cp), ranks=list(ranks),
                        num_layers=int(result.layers[row, i]),
                        recompute=result.stage_recompute(row, i),
                        predicted_peak_memory_gib=round(float(result.memory[row, i]) / cm.GIB, 6),
                        predicted_stage_time_s=float(result.stage_time[row, i]),
                        memory_capacity_gib=float(result.capacity[row, i]) / cm.GIB,
                        send_parts=int(result.send_parts[i]))
              for i, ranks in enumerate(lay.stage_ranks)]
    uniform = lay.uniform_tp
    return Plan(model=model.name, model_spec=model, cluster=cluster.name, tp=lay.tp if uniform else None,
                pp=lay.pp, dp=lay.dp,
                micro_batch_size=result.mbs, global_batch_size=training.global_batch_size,
                seq_len=result.seq, schedule=result.schedule, virtual_stages=result.v, stages=stages,
                predicted_iteration_time_s=float(result.T[row]), objective=objective,
                predicted_peak_memory_fraction=float(result.M[row]),
                predicted_memory_variance=float(result.V[row]), emulated=cluster.is_emulated,
                training=training.plan_fields(), stage_tp=None if uniform else lay.stage_tp.tolist(),
                crossings=crossings_of(result, row, model, training, cluster), cp=lay.cp,
                stage_dp=None if lay.stage_dp is None else lay.stage_dp.tolist())
