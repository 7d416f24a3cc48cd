"""TP collectives run behind the GEMMs they feed or follow (Megatron's userbuffers, Transformer
Engine's ``tp_comm_overlap``; torch's AsyncTP), and what that takes from the GEMMs. No torch import.
"""

from __future__ import annotations

import numpy as np

# SMs Transformer Engine's userbuffers take from the GEMM behind which each forward reduce-scatter
# runs (the attention's output projection's and the MLP's down projection's: ``proj_fprop`` and
# ``fc2_fprop``, its "pipeline" method with ``set_sm_margin``): 16 in its defaults
# (``pytorch/module/base.py``, ``initialize_ub``), 24 and 16 in NVIDIA's tuned configurations
# (``userbuffers_*_h100_h8192_tp4_mbs1_seqlen8192``): the fewer, 16. Its defaults take 16 from the
# backward's bulk overlaps too, which the tuned configurations do not: not counted.
USERBUFFERS_SM_MARGIN = 16


def chunked_behind(comm_s, gemm_s, tp):
    """Seconds of TP collectives split into TP chunks that run behind the GEMMs they feed or follow
    (Megatron's userbuffers, torch's AsyncTP): the first chunk waits, and whatever the GEMMs
    cannot cover."""
    return np.maximum(comm_s - gemm_s, comm_s / np.maximum(tp, 1.0))


def sm_margin_seconds(reduce_scattered_gemm_s, sms) -> np.ndarray:
    """Seconds the GEMMs behind userbuffers' forward reduce-scatters lose to the SMs the collective
    takes (:data:`USERBUFFERS_SM_MARGIN`): they run on the rest of the device's ``sms``."""
    sms = np.asarray(sms, dtype=np.float64)
    return np.asarray(reduce_scattered_gemm_s) * USERBUFFERS_SM_MARGIN / np.maximum(sms - USERBUFFERS_SM_MARGIN, 1.0)
