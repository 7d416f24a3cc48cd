"""Activation offloading (Megatron's ``--cpu-offloading-num-layers``): what it takes off a
stage's memory and what its copies add to the stage's time. No torch import.

A stage offloads its first layers' kept activations: each goes to host memory once its layer's
forward ends, while the next layer's forward runs, and comes back while the backward of the layer
above it runs, ahead of its own. The stage's last layer keeps its activations (its backward
starts right after its forward). A copy that takes longer than the compute it hides behind
stalls the stage for the rest.
"""

from __future__ import annotations

import numpy as np

# Share of a layer's forward-and-backward time its forward takes (one GEMM of three per weight);
# the backward takes the rest.
FORWARD_SHARE = 1.0 / 3.0


def exposed_copy_seconds(layer_bytes, layer_s, host_gbps):
    """Seconds one offloaded layer's two copies of ``layer_bytes`` (one micro-batch's kept
    activations) add per micro-batch beyond the compute they hide behind: out behind the next
    layer's forward, back behind the backward of the layer above (``layer_s``: one layer's
    forward and backward)."""
    copy = np.asarray(layer_bytes, dtype=np.float64) / (np.asarray(host_gbps, dtype=np.float64) * 1e9)
    layer_s = np.asarray(layer_s, dtype=np.float64)
    return np.maximum(copy - FORWARD_SHARE * layer_s, 0.0) + np.maximum(copy - (1.0 - FORWARD_SHARE) * layer_s, 0.0)


def offloaded_bytes(layers: int, kept_bytes, layer_bytes):
    """Bytes off the device of a stage offloading ``layers`` layers, each keeping ``kept_bytes``
    (all its in-flight micro-batches') of which one micro-batch's ``layer_bytes``: one
    micro-batch's layer stays, in transit."""
    return layers * np.asarray(kept_bytes) - (layer_bytes if layers else 0.0)
