"""Context parallelism as torch's ``context_parallel`` runs it (torchtitan; ``cp_all_gather``) and
K and V repeated to the query heads (torchtitan's LLaMA; ``repeat_kv``): torch's ring traced in
one process on a fake process group, and memx's time and memory of it."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from one_node import H100, one_node
from torch.distributed.tensor.experimental._context_parallel import _attention
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from memx_launch.planning import context_parallel, costmodel as cm, elementwise
from memx_launch.planning.activations import activation_bytes, mlp_bytes
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec

LLAMA3 = get_model("llama3-8b")  # 32 query heads, 8 KV heads
NODE = one_node(H100, 8, 450)
TWO_NODES = {**NODE, "nodes": [NODE["nodes"][0]] * 2, "inter_node_gbps": 50}
TORCH_RING = dict(setup="torchtitan")
TE_RING = dict(setup="torchtitan", cp_all_gather=False, repeat_kv=False)


class _RingEvents(TorchDispatchMode):
    """The ring's collectives and waits, in order, among the attention steps the test's op logs."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "all_gather" in name:
            self.events.append(("gather", args[0].dtype, args[0].numel()))
        elif "all_to_all" in name:
            self.events.append(("send", args[0].dtype, args[0].numel()))
        elif "wait_tensor" in name:
            self.events.append(("wait",))
        return func(*args, **(kwargs or {}))


class _AttentionStandIns:
    """torch's ring's attention ops stood in: outputs of the right shapes, each call logged in
    ``calls``; while one runs (``inside``), the tensors made are the op's, not the ring's."""

    def __init__(self, calls):
        self.calls, self.inside = calls, False

    def forward(self, query, key, value, is_causal=False, **_):
        return self._run(lambda: (torch.zeros_like(query), torch.zeros(query.shape[:-1])))

    def backward(self, query, key, value, out, logsumexp, is_causal=False, **_):
        return self._run(lambda: (torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)))

    def _run(self, make):
        self.calls.append(("attention",))
        self.inside = True
        try:
            return make()
        finally:
            self.inside = False


def _ring(cp: int, q, k, v, ops, forward_mode, backward_mode):
    """torch's ring forward, then backward, under ``forward_mode`` and ``backward_mode``, on the
    last rank of a CP group of ``cp`` on torch's fake backend, whose collectives return tensors of
    the right size and move nothing, which is all a trace needs. Returns the gradients."""
    dist.init_process_group("fake", store=FakeStore(), rank=cp - 1, world_size=cp)
    try:
        group = dist.group.WORLD
        with forward_mode:
            out, lse = _attention._templated_ring_attention(group, 2, ops.forward, q, k, v, is_causal=True)[:2]
        with backward_mode:
            return _attention._templated_ring_attention_backward(group, 2, ops.backward, torch.zeros_like(q),
                                                                 "grad_out", q, k, v, out.to(q.dtype), lse,
                                                                 is_causal=True)[:3]
    finally:
        dist.destroy_process_group()


def test_torchs_ring_gathers_the_keys_once_a_pass_and_rings_their_gradients_in_fp32():
    events = []
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.bfloat16) for _ in range(3))
    chunk = k.numel() + v.numel()
    grads = _ring(4, q, k, v, _AttentionStandIns(events), _RingEvents(events), _RingEvents(events))
    gather, attention, wait = ("gather", torch.bfloat16, chunk), ("attention",), ("wait",)
    send = ("send", torch.float32, chunk)  # dK and dV, accumulated and sent in fp32
    # Forward: one all-gather of the rank's K and V, waited for after its own chunk's attention.
    # Backward: the gather again; each step's dK and dV sent on, waited for after the next step's
    # attention; the last one waited for with nothing after it.
    assert events == [gather, attention, wait, attention, attention, attention,
                      gather, attention, send, wait, attention, wait, send, attention, wait, send,
                      attention, wait, send, wait]
    assert all(g.dtype == torch.bfloat16 for g in grads)


def test_torchs_ring_exposes_the_gather_past_the_first_step_and_the_last_gradient_hop():
    forward, backward, again = 1.0, 2.5, np.array([False, True])  # no recompute, full
    # cp 4: the gather (3 hops of 0.5) outlasts the first step's forward by 0.5, not its backward;
    # the fp32 gradient hops (1.0) hide behind each later step's backward but the last.
    ring = context_parallel.layer_seconds(forward, backward, 0.5, 1.0, 4, again, all_gather=True)
    assert ring.tolist() == pytest.approx([3 * 3.5 + 0.5 + 1.0, 3 * 4.5 + 2 * 0.5 + 1.0])
    # Slow links: the gather outlasts every pass's first step, each gradient hop its step.
    slow = context_parallel.layer_seconds(forward, backward, 3.0, 6.0, 4, again, all_gather=True)
    assert slow.tolist() == pytest.approx([3 * 3.5 + 8.0 + 6.5 + 3 * 3.5 + 6.0, 3 * 4.5 + 2 * 8.0 + 6.5 + 3 * 3.5 + 6.0])


def test_the_chunks_carry_the_repeated_heads_and_fp32_gradients():
    te, torch_ring = TrainingSpec(**TE_RING), TrainingSpec(**TORCH_RING)
    assert torch_ring.cp_all_gather and torch_ring.repeat_kv and not TrainingSpec(setup="megatron").repeat_kv
    te_chunk = float(context_parallel.kv_chunk_bytes(LLAMA3, te, 1, 32768, 1, 4))
    assert te_chunk == 2 * 8192 * 1024 * 2  # K and V of 8,192 tokens, 8 heads of 128, in bf16
    assert float(context_parallel.kv_chunk_bytes(LLAMA3, torch_ring, 1, 32768, 1, 4)) == 4 * te_chunk
    assert context_parallel.gradient_chunk_share(torch_ring) == 2.0 and context_parallel.gradient_chunk_share(te) == 1.0
    # While a layer's attention runs: 4 gathered chunks, the rank's own copy, dK and dV three times in fp32.
    assert context_parallel.ring_buffer_bytes(1.0, 4, torch_ring) == 4 + 1 + 3 * 2
    assert context_parallel.ring_buffer_bytes(1.0, 4, te) == 4


def test_the_rings_buffers_reuse_what_the_mlps_backward_freed():
    """A layer's backward runs the MLP's before the attention's: the ring's buffers, alive while
    the attention runs, add to the working set only what they exceed the MLP's tensors by."""
    training, tokens = TrainingSpec(**TORCH_RING), 32768  # CP 8 at 262,144 tokens
    mlp = float(mlp_bytes(LLAMA3, training, 1, tokens, 1))
    assert mlp == 4 * tokens * LLAMA3.ffn_hidden_size * 2  # SwiGLU's gate, up, silu(gate) and product in bf16
    buffers = float(context_parallel.ring_buffer_bytes(context_parallel.kv_chunk_bytes(LLAMA3, training, 1, 262144,
                                                                                      1, 8), 8, training))
    assert buffers == 15 * 2 * tokens * LLAMA3.q_hidden_size * 2 > mlp
    assert float(context_parallel.ring_working_bytes(LLAMA3, training, 1, 262144, 1, 8)) == pytest.approx(buffers - mlp)
    # Transformer Engine's four chunks of 8 KV heads fit in what the MLP freed: nothing added.
    assert float(context_parallel.ring_working_bytes(LLAMA3, TrainingSpec(**TE_RING), 1, 262144, 1, 8)) == 0.0


def test_repeated_keys_are_kept_at_the_query_width():
    seq, tp = 4096, 2
    kept = [activation_bytes(LLAMA3, 1, seq, tp, cm.NONE, repeat_kv=r).activation_bytes for r in (False, True)]
    extra = 2 * seq * (LLAMA3.q_hidden_size - LLAMA3.kv_hidden_size) / tp * 2  # K and V at 32 heads, not 8, in bf16
    assert float(kept[1] - kept[0]) == pytest.approx(extra, rel=1e-12)


def _estimate(seq, cp, dp, **training):
    spec = TrainingSpec(global_batch_size=16, seq_len=seq, **training)
    return evaluate_layout(LLAMA3, ClusterSpec.from_dict(TWO_NODES), spec, tp=1, pp=1, dp=dp, cp=cp,
                           micro_batch_size=1, references=(1.0, 1.0, 1.0), recompute="full")


def test_torchtitans_ring_is_never_faster_and_holds_more_than_transformer_engines():
    for seq, cp, dp in ((65536, 2, 8), (131072, 4, 4), (262144, 16, 1)):  # CP 16 spans both nodes
        torch_ring, te = _estimate(seq, cp, dp, **TORCH_RING), _estimate(seq, cp, dp, **TE_RING)
        assert torch_ring.predicted_iteration_time_s >= te.predicted_iteration_time_s
        extra = torch_ring.stages[0].memory_parts_gib["activations"] - te.stages[0].memory_parts_gib["activations"]
        added = [float(context_parallel.ring_working_bytes(LLAMA3, TrainingSpec(**t), 1, seq, 1, cp)) / cm.GIB
                 for t in (TORCH_RING, TE_RING)]
        assert extra >= added[0] - added[1] > 0  # the gathered, repeated chunks and fp32 gradients
    # Across the nodes the gather outlasts the first step's attention: the step is slower.
    assert _estimate(262144, 16, 1, **TORCH_RING).predicted_iteration_time_s > \
        1.05 * _estimate(262144, 16, 1, **TE_RING).predicted_iteration_time_s


def test_repeating_the_keys_moves_what_the_traffic_counts():
    """torchtitan's ``repeat_kv`` on one of K and V, traced: its copy reads the KV width (the
    expanded view's storage) and writes the query width; its backward sums the gradient back."""
    from traced import byte_counter

    tokens, kv_heads, n_rep, head_dim = 16, 2, 4, 8
    k = torch.randn(1, tokens, kv_heads, head_dim, dtype=torch.bfloat16, requires_grad=True)
    with byte_counter(storage=True) as forward:
        repeated = k.unsqueeze(3).expand(1, tokens, kv_heads, n_rep, head_dim).reshape(1, tokens, kv_heads * n_rep,
                                                                                         head_dim)
    gradient = torch.ones_like(repeated)
    with byte_counter(storage=True) as backward:
        torch.autograd.grad(repeated, k, gradient)
    kv_width, q_width = kv_heads * head_dim, kv_heads * n_rep * head_dim
    # memx counts K's and V's copies, REPEAT_KV_BYTES x (q + kv) x d per token each way: half of it each.
    counted = [b / 2 * tokens * (q_width + kv_width) * 2 for b in elementwise.REPEAT_KV_BYTES]
    assert [forward.total, backward.total] == counted


def test_repeated_keys_add_their_copies_to_a_blocks_traffic():
    seq, tp = 8192, 2
    traffic = [elementwise.elementwise_traffic_bytes(LLAMA3, TrainingSpec(setup="torchtitan", repeat_kv=r), 1, seq, tp,
                                                     level) for r in (False, True) for level in (cm.NONE, cm.FULL)]
    copies = seq * (LLAMA3.q_hidden_size + LLAMA3.kv_hidden_size) / tp * 2.0 * 2  # K and V, bf16
    assert float(traffic[2] - traffic[0]) == pytest.approx(2 * copies)  # forward and backward
    assert float(traffic[3] - traffic[1]) == pytest.approx(3 * copies)  # and the recomputed forward
    mha = get_model("llama2-7b")  # as many KV heads as query heads: torchtitan's repeat_kv returns its input
    assert float(elementwise.elementwise_traffic_bytes(mha, TrainingSpec(setup="torchtitan"), 1, seq, tp, cm.NONE)) == \
        float(elementwise.elementwise_traffic_bytes(mha, TrainingSpec(setup="torchtitan", repeat_kv=False), 1, seq, tp,
                                                    cm.NONE))


def _ring_bytes(cp: int, kv_heads: int) -> tuple[float, float]:
    """HBM bytes torch's ring moves itself (neither its attention ops nor its collectives) on the
    last rank of a CP group of ``cp``, forward and backward, per element of the rank's queries:
    4 query heads of 128 (the per-head log-sum-exp is as small beside them as on a real model)."""
    from traced import byte_counter

    q = torch.randn(1, 4, 16, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(1, kv_heads, 16, 128, dtype=torch.bfloat16) for _ in range(2))
    ops = _AttentionStandIns([])

    def the_rings(func, args, out):
        name = str(func)
        return not (ops.inside or "c10d" in name or "empty" in name)
    forward, backward = byte_counter(the_rings, storage=True), byte_counter(the_rings, storage=True)
    _ring(cp, q, k, v, ops, forward, backward)
    return forward.total / q.numel(), backward.total / q.numel()


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_rings_own_traffic_is_what_torch_moves(cp):
    """Traced on the group's last rank, which merges and accumulates the most: the forward's fp32
    merges and the backward's fp32 accumulators and concatenations, against
    RING_FORWARD_BYTES and RING_BACKWARD_BYTES, with K and V as wide as the queries and half."""
    for kv_heads in (4, 2):
        keys_per_query = kv_heads / 4
        for traced, table in zip(_ring_bytes(cp, kv_heads), (context_parallel.RING_FORWARD_BYTES,
                                                             context_parallel.RING_BACKWARD_BYTES)):
            (first_q, first_k), (step_q, step_k) = table
            counted = first_q + step_q * (cp - 1) + keys_per_query * (first_k + step_k * (cp - 1))
            assert counted == pytest.approx(traced, rel=0.01)
    # memx's count for a layer: the forward's again where the attention recomputes, none for Transformer Engine's.
    tokens, q, k = 262144 // cp, LLAMA3.q_hidden_size, LLAMA3.q_hidden_size  # torchtitan repeats K and V
    forward, backward = ((t[0][0] + t[1][0] * (cp - 1)) * q + (t[0][1] + t[1][1] * (cp - 1)) * k
                         for t in (context_parallel.RING_FORWARD_BYTES, context_parallel.RING_BACKWARD_BYTES))
    counted = context_parallel.ring_merge_bytes(LLAMA3, TrainingSpec(**TORCH_RING), 1, 262144, 1, cp,
                                                np.array([False, True]))
    assert counted.tolist() == pytest.approx([tokens * (forward + backward), tokens * (2 * forward + backward)])
    assert not context_parallel.ring_merge_bytes(LLAMA3, TrainingSpec(**TE_RING), 1, 262144, 1, cp, True).any()
