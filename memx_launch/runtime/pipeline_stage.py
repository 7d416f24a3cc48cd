"""torch's PipelineStage across communication domains: each transfer to a stage on another
domain takes the bridge, staged through host memory (runtime/communication.py)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from memx_launch.runtime.communication import Communicator


class DomainPipelineStage(PipelineStage):
    """torch's PipelineStage whose transfers to a stage on another domain take the bridge, staged
    through host memory; transfers inside a domain use the domain's native group. ``group`` is
    the pipeline's group (a bridge when the pipeline crosses domains): torch's warm-up vote and
    shape metadata go over it as host tensors."""

    def __init__(self, *args, communicator: Communicator, **kwargs):
        super().__init__(*args, **kwargs)
        self.communicator = communicator
        self._staged_recvs: dict[int, torch.Tensor] = {}  # id of a recv buffer -> the host copy filled for it
        self._staged_sends: list[torch.Tensor] = []  # host copies alive until the step ends

    def _route(self, op: dist.P2POp, receiving: bool) -> dist.P2POp:
        comm = self.communicator
        pair = (comm.rank, op.peer)
        if not comm.spans_domains(pair):
            if not comm.is_bridge(op.group):
                return op
            return dist.P2POp(op.op, op.tensor, op.peer, comm.pair_group(op.peer))
        if receiving:
            host = comm.host_buffer(op.tensor)
            self._staged_recvs[id(op.tensor)] = host
        else:
            host = comm.stage(op.tensor)
            self._staged_sends.append(host)
        if receiving:
            comm.traffic.messages += 1
            comm.traffic.bytes += host.numel() * host.element_size()
        return dist.P2POp(op.op, host, op.peer, self.group)

    def _get_recv_ops(self, recv_infos):
        return [self._route(op, receiving=True) for op in super()._get_recv_ops(recv_infos)]

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        return [self._route(op, receiving=False) for op in super().get_fwd_send_ops(fwd_chunk_id)]

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        return [self._route(op, receiving=False) for op in super().get_bwd_send_ops(bwd_chunk_id)]

    def _unstage(self, recv_infos) -> None:
        for info in recv_infos:
            host = self._staged_recvs.pop(id(info.buffer), None) if info.buffer is not None else None
            if host is not None:
                self.communicator.unstage(host, info.buffer)

    def _retrieve_recv_activations(self, fwd_chunk_id: int):
        self._unstage(self.args_recv_info[fwd_chunk_id])
        return super()._retrieve_recv_activations(fwd_chunk_id)

    def _retrieve_recv_grads(self, bwd_chunk_id: int):
        self._unstage(self.grad_recv_info[bwd_chunk_id])
        return super()._retrieve_recv_grads(bwd_chunk_id)

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self._staged_sends.clear()

    # torch's warm-up vote and shape metadata: host tensors when the pipeline group is a bridge.
    @contextmanager
    def _control_on_host(self):
        if not self.communicator.is_bridge(self.group):
            yield
            return
        device = self.device
        self.device = torch.device("cpu")
        try:
            with self.communicator.on_host():
                yield
        finally:
            self.device = device

    def _warmup_forward_vote(self, has_backward, received_acc=None):
        with self._control_on_host():
            return super()._warmup_forward_vote(has_backward, received_acc)

    def _warmup_backward_result(self, received_result=None):
        with self._control_on_host():
            return super()._warmup_backward_result(received_result)

    def _send_meta(self, meta, dst_stage):
        with self._control_on_host():
            super()._send_meta(meta, dst_stage)

    def _recv_meta(self, src_stage):
        with self._control_on_host():
            return super()._recv_meta(src_stage)
