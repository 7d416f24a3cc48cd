"""Every parallel form trains on the emulated clusters (examples/clusters/cpu-emulated.yaml, and
cpu-two-vendors.yaml across vendors; llama-tiny) within BOUND times the step time memx predicts for it (the analytical model of memx plan
and memx estimate), all forms in one 4-rank gloo launch. Before the emulation stopped charging
collective waits as compute (issue 22), TP plans never finished a step."""

import pytest

from benchmarks.emulated_step_time import FORMS, form_plans, train_forms
from ranks import spawn_ranks

# The target is 3x (benchmarks/emulated_step_time.py measures it quiet, more steps); a 2-core
# machine shared with another 4-process job measured 4.3x. The bound catches what it guards against,
# waits charged as compute, which grew every step past 20x.
BOUND = 6.0
# The first step also builds what later steps reuse (DTensor's sharding caches, DDP's buckets); of
# the later ones the fastest is judged, as other jobs on a shared CI machine slow single steps.
STEPS = 3


def test_every_form_fits_the_emulated_devices_with_room():
    assert all(stage.predicted_peak_memory_gib < 0.8 * stage.memory_capacity_gib  # the guard refuses more
               for _, plan in form_plans().values() for stage in plan.stages)


@pytest.mark.slow
def test_every_parallel_form_trains_within_a_bound_of_its_predicted_step_time():
    results = spawn_ranks(train_forms, 4, STEPS, timeout=300)[0]
    assert list(results) == list(FORMS)
    for name, (layout, predicted, times) in results.items():
        print(f"{name}: {layout}: steps {', '.join(f'{t:.2f}' for t in times)} s, predicted {predicted:.2f} s")
    slow = {name: f"{min(times[1:]):.2f} s is {min(times[1:]) / predicted:.1f}x the predicted {predicted:.2f} s "
            f"({layout})" for name, (layout, predicted, times) in results.items()
            if min(times[1:]) > BOUND * predicted}
    assert not slow, slow
