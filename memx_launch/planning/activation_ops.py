"""An ungated MLP's activation as torch ops, where no kernel fuses it (Transformers' blocks, eager
frameworks): what it keeps for its backward, what that backward holds at once and what it moves
through HBM, against GELU's kernel (its input kept, one tensor of the MLP's width held, 2d read
and written forward, 3d backward). Traced on Transformers' own MLPs, in fp32 and under bf16
autocast over fp32 weights (tests/test_framework_memory.py; the held bytes measured on the
layers, tests/test_model_families.py). No torch import.
"""

from __future__ import annotations

from memx_launch.specs.model import ModelSpec

# GELU's kernel: (forward, backward) d per element of the MLP's width.
GELU_BYTES = (2.0, 3.0)
# GELU's tanh form as eight torch ops (Transformers' gelu_new, ``tanh_gelu_ops``): 18d forward, 28d backward.
TANH_GELU_OPS_BYTES = (18.0, 28.0)
# Squared ReLU as relu and square (Transformers' relu2, ``squared_relu_ops``): relu's output kept where GELU
# keeps its input; 4d forward, 10d backward, the square's backward holding x^1, 2x and their product.
SQUARED_RELU_OPS_BYTES = (4.0, 10.0)
# BLOOM's GELU (``bloom_gelu_ops``, Transformers' GeLUFunction): its input kept, as GELU's kernel keeps it; its
# forward nine torch ops of the tanh form (12d read, 9d written), its backward, bloom_gelu_back, the tanh again
# and its derivative in eighteen (26d read, 18d written), of which five tensors live at once: the tanh's
# output, 0.5x, 1 - tanh^2, and 0.107x with its product by x (traced under CPU autocast and in fp32).
BLOOM_GELU_OPS_BYTES = (21.0, 44.0)
BLOOM_GELU_OPS_HELD = 5.0
# xIELU in Python ops (Apertus, ``xielu_ops``; Transformers' path without the ``xielu`` kernel): its trainable
# slopes are fp32 parameters, so under autocast the positive branch's product and the output are fp32. By the
# training dtype's bytes: the bytes it keeps beyond GELU's input (the slope's product, the negative branch's
# expm1 and its difference, the branches' 1-byte mask), the bytes its backward holds at once beyond what it
# keeps, and (forward, backward) d per element (the output's cast for the down projection included).
XIELU_OPS_KEPT = {4: 13.0, 2: 9.0}
XIELU_OPS_HELD = {4: 15.0, 2: 17.0}
XIELU_OPS_BYTES = {4: (28.5, 50.5), 2: (43.0, 83.0)}


def _kind(model: ModelSpec, fused_activation: bool) -> str:
    """Which ungated activation runs as torch ops ('' where a kernel runs it, or the MLP is gated)."""
    if fused_activation or model.gated_mlp:
        return ""
    return ("tanh_gelu" if model.tanh_gelu_ops else "squared_relu" if model.squared_relu_ops
            else "xielu" if model.xielu_ops else "bloom_gelu" if model.bloom_gelu_ops else "")


def kept_units(model: ModelSpec, fused_activation: bool, dtype_bytes: int) -> float:
    """What an ungated activation keeps beside the down projection's input, in
    :func:`~memx_launch.planning.activations.activation_bytes`' units (2 a tensor of the MLP's
    width in the training dtype): GELU's input; its tanh form as ops its input, the tanh's output
    and the two factors of its last product (8); xIELU its extra bytes."""
    kind = _kind(model, fused_activation)
    if kind == "tanh_gelu":
        return 8.0
    return 2.0 + (2.0 * XIELU_OPS_KEPT[dtype_bytes] / dtype_bytes if kind == "xielu" else 0.0)


def backward_tensors(model: ModelSpec, fused_activation: bool, dtype_bytes: int) -> float:
    """Tensors of the MLP's width an ungated activation's backward holds at once beyond what it
    keeps, in the training dtype: GELU one, its tanh form as ops two, squared ReLU three, BLOOM's five,
    xIELU its bytes'."""
    kind = _kind(model, fused_activation)
    if kind == "xielu":
        return XIELU_OPS_HELD[dtype_bytes] / dtype_bytes
    return {"tanh_gelu": 2.0, "squared_relu": 3.0, "bloom_gelu": BLOOM_GELU_OPS_HELD}.get(kind, 1.0)


def hbm_bytes(model: ModelSpec, fused_activation: bool, dtype_bytes: int) -> tuple[float, float]:
    """(forward, backward) d per element of the MLP's width an ungated activation moves."""
    kind = _kind(model, fused_activation)
    if kind == "xielu":
        return XIELU_OPS_BYTES[dtype_bytes]
    return {"tanh_gelu": TANH_GELU_OPS_BYTES, "squared_relu": SQUARED_RELU_OPS_BYTES,
            "bloom_gelu": BLOOM_GELU_OPS_BYTES}.get(kind, GELU_BYTES)
