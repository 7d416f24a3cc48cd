"""Tied embeddings across pipeline stages: the LM head holding the embedding's weight (GPT-2,
Qwen2-0.5B, Gemma). With PP > 1 the first and the last stage each keep a copy; every step they
add each other's gradient (after the DP sync: the sum of averages is the average of sums), so both
copies take the step the one weight takes in a single process. Megatron's embedding group does
the same. The sum crosses the bridge when the two stages sit in different domains. Fully sharded,
each rank sums its own shard (the reduce-scatter left it that), so both ends must be sharded alike."""

from __future__ import annotations

from torch import nn

from memx_launch.errors import ConfigError
from memx_launch.runtime.communication import Communicator
from memx_launch.runtime.layout import process_grid, stage_runs_fully_sharded


class TiedGradients:
    """This rank's copies of tied parameters and the group that sums their gradients."""

    def __init__(self, comm: Communicator, plan, tied: bool, data_parallel: str = "auto"):
        """Makes the groups on every rank (one per DP replica: its first and last stage's ranks),
        in one order; ``tied``: the model has tied parameters (the same on every rank)."""
        self.comm = comm
        self.ranks: list[int] = []
        self.parameters: list[nn.Parameter] = []
        """This stage's copies of parameters another stage holds too."""
        if not tied or plan.pp == 1:
            return
        grid = process_grid(plan)
        check_ends_sharded_alike(plan, grid, comm.spans_domains, data_parallel)
        for d in range(plan.dp):
            ranks = sorted(set(grid[0][d]) | set(grid[-1][d]))
            comm.prepare_all_reduce(ranks)
            self.ranks = ranks if comm.rank in ranks else self.ranks

    def sum_grads(self, tp_index: int) -> None:
        """Add the other end's gradients to this stage's copies. The TP ranks of a stage hold the
        same gradient (embedding and head are not split): only TP rank 0 contributes."""
        grads = [getattr(p.grad, "_local_tensor", p.grad) for p in self.parameters if p.requires_grad]
        if not grads:  # none, or frozen (fine-tuning): both ends hold the same copy of the user's model
            return
        if tp_index:
            for g in grads:
                g.zero_()
        self.comm.all_reduce_sums(grads, self.ranks)


def check_ends_sharded_alike(plan, grid, spans_domains, data_parallel: str) -> None:
    """A one-line refusal where memx-run would run one end of a tied pair fully sharded and the
    other whole (:func:`stage_runs_fully_sharded`: a TP 1 stage beside a TP > 1 one, or a DP group
    across domains beside one within a domain): a shard and a whole gradient cannot be summed."""
    ends = [stage_runs_fully_sharded(plan, len(grid[s][0]), spans_domains([r[0] for r in grid[s]]), data_parallel)
            for s in (0, plan.pp - 1)]
    if ends[0] != ends[1]:
        which = ("first", "last") if ends[0] else ("last", "first")
        raise ConfigError("--plan", f"the first and the last stage sum their tied embeddings' gradients, but "
                          f"memx's runtime would shard the {which[0]} (FSDP2) and keep the {which[1]}'s whole",
                          "plan the two stages alike: one TP degree, their DP groups both within a domain or "
                          "both across (the plan's training fully sharded)")
