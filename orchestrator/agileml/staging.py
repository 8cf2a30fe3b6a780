"""Host buffers for a worker on a GPU: its gradients leave the device through pinned memory.

On a GPU, a push needs the gradient on the host. `PushStaging` copies every parameter's
gradient (and the buffers' change) into one pinned float32 vector per identity the worker
computes for, without blocking per tensor, and waits for the copies once; the partitions
pushed are views of that vector, reused every iteration (no staging memory is allocated per
iteration). A vector is written again only in a later iteration, after every push sent from it
was acknowledged (`Worker.step` waits for the acks). On the CPU the worker pushes views of its
gradients and needs none of this.

Pulled partitions are copied into the parameters straight from the received frames (pageable
memory: ZMQ allocates them), one copy per parameter piece (`PartitionLayout.scatter`).

Never run on a GPU here: the tests run it on the CPU, unpinned.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from orchestrator.agileml.partitions import PartitionLayout


class PushStaging:
    """One reused host vector per identity (its own and adopted shares): see the module
    docstring. `pin`: page-locked memory (needs CUDA)."""

    def __init__(self, layout: PartitionLayout, device: torch.device, *, pin: bool) -> None:
        self._layout = layout
        self._device = device
        self._pin = pin
        self._vectors: dict[str, torch.Tensor] = {}

    def gradients(
        self, identity: str, params: Sequence[torch.Tensor], buffer_delta: torch.Tensor | None
    ) -> torch.Tensor:
        """The gradients of `params` (a missing one as 0), then `buffer_delta` (zeros if
        None), in `identity`'s host vector; returns the vector (partition p is
        `vector[layout.slice(p)]`)."""
        layout = self._layout
        out = self._vectors.get(identity)
        if out is None:
            out = torch.empty(layout.total, pin_memory=self._pin)
            self._vectors[identity] = out
        offset = 0
        for p in params:
            n = p.numel()
            piece = out[offset : offset + n]
            if p.grad is None:
                piece.zero_()
            else:
                piece.copy_(p.grad.detach().reshape(-1), non_blocking=self._pin)
            offset += n
        rest = out[layout.param_total :]
        if buffer_delta is None:
            rest.zero_()
        else:
            rest.copy_(buffer_delta.reshape(-1), non_blocking=self._pin)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # the copies are in the vector now
        return out

    def keep_only(self, identities: set[str]) -> None:
        """Forget the vectors of identities no longer computed for (ended adoptions)."""
        for identity in set(self._vectors) - identities:
            del self._vectors[identity]
