"""torch's PipelineStage with memx's links between stages: stages of different TP degree, and
stages on different communication domains (each transfer between domains takes the bridge,
staged through host memory: runtime/communication.py); its forward and backward chunks timed
(runtime/stage_clock.py); its receive buffers held only while their micro-batch needs them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import (_DTensorMeta, _make_tensor_from_meta, _StageBackwardMeta,
                                                 _StageForwardMeta, _TensorMeta)
from torch.distributed.pipelining.stage import InferenceMode, _RecvInfo

from memx_launch.errors import ConfigError
from memx_launch.runtime.communication import Communicator
from memx_launch.runtime.messages import recv_json, send_json
from memx_launch.runtime.stage_clock import StageClock

MAX_META_TENSORS = 64
MAX_META_DIMS = 16


@dataclass(frozen=True)
class PipelineLinks:
    """The process ranks one rank exchanges pipeline transfers with. Every TP rank of a stage
    holds the whole activation at a stage boundary. Between adjacent stages TP rank t of one
    sends to TP rank t of the other, for each t below the smaller TP degree: where the receiving
    stage has more TP ranks, its rank 0 broadcasts what it received over its TP group (each tensor
    crosses the link once per pair, never once per receiver). Between two stages of one TP degree
    a plan that partitions the edge (the stage's ``send_parts``) sends each peer a TP-th of the
    tensor, which the receiving stage all-gathers over its TP group; planning/pipeline_sends.py
    prices both. Shape metadata, exchanged once, reaches every rank directly: stage s's TP rank t
    takes it from the previous stage's rank t mod tp(s-1) and gives it to each next-stage rank u
    with u mod tp(s) == t.
    Gradients go back by the same rules; stages are taken modulo the pipeline depth (under
    interleaving the last stage feeds the first)."""

    prev_peer: int | None
    """The previous stage's rank this one receives activations from and sends their gradients to;
    None: beyond its TP degree, its TP group's broadcast brings them and it sends none back."""
    next_peer: int | None
    """The next stage's rank this one sends activations to and receives their gradients from."""
    meta_fwd_in: int
    meta_fwd_out: tuple[int, ...]
    meta_bwd_in: int
    meta_bwd_out: tuple[int, ...]
    groups: dict
    """Peer process rank -> the group of that edge (native in one domain, else a bridge)."""
    prev_parts: int = 1
    """The parts each transfer with the previous stage is split into (1: whole)."""
    next_parts: int = 1
    """The parts each transfer with the next stage is split into (1: whole)."""
    prev_broadcast: bool = False
    """What the previous stage sends is broadcast over this stage's TP group (it has more TP ranks)."""
    next_broadcast: bool = False
    """What the next stage sends back is broadcast over this stage's TP group."""
    tp_index: int = 0
    """This rank's index in its stage's TP group (its rank there: groups number ranks in
    ascending order, as the grid holds them): its peer's index, the part it sends and receives."""
    tp_group: dist.ProcessGroup | None = None
    """This stage's native TP group: its all-gathers and broadcasts of what arrives."""

    @classmethod
    def of(cls, grid, stage: int, replica: int, tp_index: int, groups: dict, tp_group: dist.ProcessGroup | None,
           parts: list[int]) -> "PipelineLinks":
        """``grid``: process ranks [stage][replica][tp index]; ``tp_group``: this stage's TP group
        (None at TP 1); ``parts``: the parts each stage's sends to the next are split into, as the
        plan priced them (its stages' ``send_parts``)."""
        p = len(grid)
        prev, nxt = grid[(stage - 1) % p][replica], grid[(stage + 1) % p][replica]
        tp, t = len(grid[stage][replica]), tp_index
        def peer(other) -> int | None:
            return other[t] if t < len(other) else None
        def meta_out(other) -> tuple[int, ...]:
            return tuple(r for u, r in enumerate(other) if u % tp == t)
        return cls(prev_peer=peer(prev), next_peer=peer(nxt),
                   meta_fwd_in=prev[t % len(prev)], meta_fwd_out=meta_out(nxt),
                   meta_bwd_in=nxt[t % len(nxt)], meta_bwd_out=meta_out(prev), groups=groups,
                   prev_parts=int(parts[(stage - 1) % p]), next_parts=int(parts[stage]),
                   prev_broadcast=tp > len(prev), next_broadcast=tp > len(nxt), tp_index=t, tp_group=tp_group)


class DomainPipelineStage(PipelineStage):
    """torch's PipelineStage whose transfers follow :class:`PipelineLinks`: over the edge's
    native group inside a domain, over the bridge (host copies) between domains. ``group`` (this
    rank's lane: one rank per stage) only numbers the stages for torch; the warm-up vote needs no
    exchange (memx builds every stage alike) and shape metadata goes over the links as JSON
(:func:`encode_meta`), never pickled as torch's ``send_object_list`` would. Each chunk's
forward and backward run inside a span of ``clock``."""

    def __init__(self, *args, communicator: Communicator, links: PipelineLinks, clock: StageClock, **kwargs):
        super().__init__(*args, **kwargs)
        self.communicator = communicator
        self.links = links
        self.clock = clock
        self._staged_recvs: dict[int, torch.Tensor] = {}  # id of a recv tensor -> the host copy filled for it
        self._received_parts: dict[int, torch.Tensor] = {}  # id of a recv buffer -> the part received for it
        self._vote: torch.Tensor | None = None

    # Each chunk's receives are completed (unstaged, gathered) before its span: the clock times compute.
    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self._complete(self.args_recv_info[fwd_chunk_id], self.links.prev_broadcast)
        with self.clock.span():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self._complete(self.grad_recv_info.get(bwd_chunk_id, ()), self.links.next_broadcast)
        with self.clock.span():
            result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        for info in (*self.args_recv_info.get(bwd_chunk_id, ()), *self.grad_recv_info.get(bwd_chunk_id, ())):
            if not info.is_root_arg:
                info.buffer = None  # the micro-batch is done: its input and gradient go back to the allocator
        return result

    # ---- receive buffers: torch allocates one per micro-batch for the stage's input and one for its
    # output's gradient when the schedule first runs, and keeps them all for the job (2 x G stage
    # boundaries). Here each is allocated when its receive is posted and let go after its backward.
    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        super()._setup_forward_recv_info(1, has_backward)  # one micro-batch's, its buffer dropped below
        self.args_recv_info = {chunk: tuple(_unallocated(info) for info in self.args_recv_info[0])
                               for chunk in range(num_microbatches)}

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
        return tuple(_unallocated(info) for info in super()._create_grad_recv_info(act_send_info))

    def _allocate(self, recv_infos) -> None:
        for info in recv_infos:
            if not info.is_root_arg and info.tensor_meta is not None and info.buffer is None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

    def backward_weight_one_chunk(self, *args, **kwargs):
        with self.clock.span():
            return super().backward_weight_one_chunk(*args, **kwargs)

    def _op(self, op: dist.P2POp, peer: int, receiving: bool, parts: int) -> dist.P2POp:
        """``op`` to ``peer`` over its edge's group: a ``parts``-th of the tensor (this TP rank's)
        where the edge is partitioned, staged through host memory where the group is a bridge. A
        send's copy lives in the op, then in the work the schedule waits on (gloo's send work holds
        its tensor, NCCL stashes it): none outlives its wait, where a step's copies would pile up."""
        comm = self.communicator
        tensor = op.tensor
        if parts > 1 and tensor.numel() % parts == 0:  # the peer splits by the same rule
            if receiving:
                tensor = torch.empty(tensor.numel() // parts, dtype=tensor.dtype, device=tensor.device)
                self._received_parts[id(op.tensor)] = tensor
            else:
                tensor = tensor.detach().reshape(-1).chunk(parts)[self.links.tp_index].contiguous()
        group = self.links.groups[peer]
        if not comm.is_bridge(group):
            return dist.P2POp(op.op, tensor, peer, group)
        if receiving:
            host = comm.receive_buffer(tensor)
            self._staged_recvs[id(tensor)] = host
        else:
            host = comm.send_copy(tensor)
        return dist.P2POp(op.op, host, peer, group)

    def _ops(self, ops, peer: int | None, receiving: bool, parts: int) -> list[dist.P2POp]:
        return [] if peer is None else [self._op(op, peer, receiving, parts) for op in ops]

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return self._ops(super().get_fwd_recv_ops(fwd_chunk_id), self.links.prev_peer, True, self.links.prev_parts)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        self._allocate(self.grad_recv_info[bwd_chunk_id])
        return self._ops(super().get_bwd_recv_ops(bwd_chunk_id), self.links.next_peer, True, self.links.next_parts)

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        return self._ops(super().get_fwd_send_ops(fwd_chunk_id), self.links.next_peer, False, self.links.next_parts)

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        return self._ops(super().get_bwd_send_ops(bwd_chunk_id), self.links.prev_peer, False, self.links.prev_parts)

    def _complete(self, recv_infos, broadcast: bool) -> None:
        """Fill the buffers of a chunk's finished receives: host copies unstaged, parts all-gathered,
        and where ``broadcast``, TP rank 0's buffer sent to the TP ranks that had no peer."""
        for info in recv_infos:
            if info.is_root_arg or info.buffer is None:
                continue
            part = self._received_parts.pop(id(info.buffer), None)
            received = info.buffer if part is None else part
            host = self._staged_recvs.pop(id(received), None)
            if host is not None:
                self.communicator.unstage(host, received)
            with torch.no_grad():
                if part is not None:
                    dist.all_gather_single(info.buffer.view(-1), part, group=self.links.tp_group)
                if broadcast:
                    dist.broadcast(info.buffer, group_src=0, group=self.links.tp_group)

    # ---- torch's control plane
    def _warmup_forward_vote(self, has_backward, received_acc=None):
        # Every stage votes for static shapes only when it was given them; memx gives none to
        # any stage, so each stage's own vote is the pipeline's and nothing is exchanged.
        vote = 0 if InferenceMode.needs_dynamic(self._user_meta, has_backward) else 1
        self._vote = torch.tensor([vote], dtype=torch.int32)
        return self._vote

    def _warmup_backward_result(self, received_result=None):
        return self._vote

    def _meta_device(self, group) -> torch.device:
        native_gloo = self.communicator.native_backend == "gloo"
        return torch.device("cpu") if native_gloo or self.communicator.is_bridge(group) else self.device

    def _send_meta(self, meta, dst_stage: int) -> None:
        forward = dst_stage == self.stage_index + 1
        for peer in self.links.meta_fwd_out if forward else self.links.meta_bwd_out:
            group = self.links.groups[peer]
            with self.communicator.on_host():
                send_json(encode_meta(meta), peer, group, self._meta_device(group))

    def _recv_meta(self, src_stage: int):
        peer = self.links.meta_fwd_in if src_stage == self.stage_index - 1 else self.links.meta_bwd_in
        group = self.links.groups[peer]
        with self.communicator.on_host():
            return decode_meta(recv_json(peer, group, self._meta_device(group)), peer)


def _unallocated(info: _RecvInfo) -> _RecvInfo:
    """``info`` without a buffer (a root argument has none)."""
    if info.is_root_arg:
        return info
    return _RecvInfo(info.input_name, info.source, None, info.tensor_meta)


def encode_meta(meta) -> dict:
    """A stage's forward (output) or backward (input gradient) tensor metadata as plain JSON data."""
    forward = isinstance(meta, _StageForwardMeta)
    metas = meta.forward_metas if forward else meta.backward_metas
    if any(isinstance(m, _DTensorMeta) for m in metas):  # memx's stage boundaries carry whole activations
        raise ConfigError("pipeline stage", "a stage boundary carries a DTensor",
                          "return plain tensors from each pipeline stage")
    return {"direction": "forward" if forward else "backward",
            "tensors": [None if m is None else {"shape": list(m.shape), "stride": list(m.stride),
                                                "dtype": str(m.dtype).removeprefix("torch."),
                                                "requires_grad": bool(m.requires_grad)} for m in metas]}


def decode_meta(data, sender: int):
    """:func:`encode_meta`'s data back as torch's metadata; anything else is one error."""
    def bad(what: str) -> ConfigError:
        return ConfigError("pipeline metadata", f"rank {sender} sent {what}",
                           "check that every rank runs the same memx version")

    if not isinstance(data, dict) or data.get("direction") not in ("forward", "backward") \
            or not isinstance(data.get("tensors"), list) or len(data["tensors"]) > MAX_META_TENSORS:
        raise bad("malformed stage metadata")
    metas = []
    for entry in data["tensors"]:
        if entry is None and data["direction"] == "backward":
            metas.append(None)
            continue
        if not isinstance(entry, dict) or set(entry) != {"shape", "stride", "dtype", "requires_grad"}:
            raise bad("a malformed tensor description")
        dims = [entry["shape"], entry["stride"]]
        if not all(isinstance(d, list) and len(d) <= MAX_META_DIMS and len(d) == len(entry["shape"])
                   and all(type(x) is int and x >= 0 for x in d) for d in dims):
            raise bad(f"tensor dimensions {entry['shape']!r} / {entry['stride']!r}")
        dtype = getattr(torch, entry["dtype"], None) if isinstance(entry["dtype"], str) else None
        if not isinstance(dtype, torch.dtype) or type(entry["requires_grad"]) is not bool:
            raise bad(f"dtype {entry['dtype']!r}")
        metas.append(_TensorMeta(torch.Size(entry["shape"]), tuple(entry["stride"]), dtype, entry["requires_grad"]))
    return _StageForwardMeta(tuple(metas)) if data["direction"] == "forward" else _StageBackwardMeta(tuple(metas))
