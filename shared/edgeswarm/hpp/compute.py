"""One device's share of one pipeline stage: forward, backward, gradient accumulation, optimizer step.

This is the compute half of a stage-worker, free of any messaging. Forward keeps the input and output of each
micro-batch until its backward (so at most K_p micro-batches are alive under the 1F1B order); the last stage
computes the loss itself. Losses use ``reduction="sum"`` times ``loss_scale`` = 1 / (loss terms in the whole
mini-batch), and data-parallel replicas SUM their gradients, so uneven shares weight every sample exactly as
single-device training on the mini-batch does (spec 6.2).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from edgeswarm.errors import EdgeswarmError
from edgeswarm.models.saved import saved_for_backward


class StageError(EdgeswarmError):
    """A stage was asked for something its state does not allow (a backward without its forward, ...)."""


def classification_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy; token outputs [N, S, V] with labels [N, S] are flattened to N*S terms."""
    if output.dim() == 3:
        return nn.functional.cross_entropy(output.flatten(0, 1), labels.flatten(), reduction="sum")
    return nn.functional.cross_entropy(output, labels, reduction="sum")


def loss_terms(labels: torch.Tensor) -> int:
    """How many loss terms a batch of labels contributes (samples, or tokens for sequence targets)."""
    return int(labels.numel())


class StageCompute:
    """Runs units of a stage module on one device's slices. ``first`` stages take data, ``last`` stages take
    labels and make the loss; ``loss_scale`` multiplies the summed loss (1 / loss terms per mini-batch).
    ``compute`` is the torch device the module lives on: inputs, labels and gradients must be there too."""

    def __init__(self, module: nn.Module, *, first: bool, last: bool, loss_scale: float = 1.0,
                 compute: torch.device | None = None) -> None:
        self.module = module
        self.compute = compute if compute is not None else torch.device("cpu")
        self.first = first
        self.last = last
        self.loss_scale = loss_scale
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._saved_bytes: dict[int, int] = {}
        # What autograd saves for one forward, by the input's shape and dtype (see ``forward``).
        self._saves: dict[tuple[tuple[int, ...], torch.dtype], int] = {}
        self.peak_live = 0
        self.peak_held_bytes = 0  # most activation bytes held for backward at once this round
        self.loss_sum = 0.0  # unscaled summed loss over the round's micro-batches (last stage)
        self.correct = 0  # correctly classified loss terms this round (last stage)
        self.terms = 0

    @property
    def live(self) -> int:
        """Micro-batches whose activations are held for a backward."""
        return len(self._saved)

    @property
    def held_bytes(self) -> int:
        """Bytes autograd keeps for the live micro-batches' backward (inputs included, weights excluded)."""
        return sum(self._saved_bytes.values())

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for p in self.module.parameters() if p.requires_grad)

    def forward(self, micro_batch: int, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Run the stage on a slice. Returns the activations to send on, or for the last stage the scaled loss
        (a scalar, already accumulated into ``loss_sum``). Raises StageError for a micro-batch already live."""
        if micro_batch in self._saved:
            raise StageError(f"micro-batch {micro_batch} already ran forward on this stage")
        x = inputs if self.first or not inputs.is_floating_point() else inputs.detach().requires_grad_(True)
        # Counting the saved tensors calls a Python hook for each one, about 1.3 ms of CPU a MobileNetV2 forward
        # (5% of it at 3 samples; an emulated device multiplies it by its slow-down): counted once per input shape,
        # since a stage in training mode saves the same tensors for every input of one shape.
        shape = (tuple(x.shape), x.dtype)
        counted = self._saves.get(shape)
        if counted is None:
            with saved_for_backward(self.module) as saved:
                out = self.module(x)
            counted = self._saves[shape] = saved.nbytes
        else:
            out = self.module(x)
        if self.last:
            if labels is None:
                raise StageError(f"the last stage needs the labels of micro-batch {micro_batch}")
            if labels.shape[0] != out.shape[0]:
                raise StageError(f"micro-batch {micro_batch}: {out.shape[0]} outputs but {labels.shape[0]} labels")
            loss = classification_loss(out, labels)
            self.loss_sum += float(loss.detach())
            self.correct += int((out.detach().argmax(dim=-1) == labels).sum())
            self.terms += loss_terms(labels)
            out = loss * self.loss_scale
        self._saved[micro_batch] = (x, out)
        self._saved_bytes[micro_batch] = counted
        self.peak_live = max(self.peak_live, self.live)
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        return out.detach()

    def backward(self, micro_batch: int, grad_output: torch.Tensor | None = None) -> torch.Tensor | None:
        """Back-propagate one micro-batch, accumulating parameter gradients. Returns the gradient for the
        previous stage (None for the first stage). The last stage needs no ``grad_output``."""
        try:
            x, out = self._saved.pop(micro_batch)
            del self._saved_bytes[micro_batch]
        except KeyError:
            raise StageError(f"backward of micro-batch {micro_batch} without its forward on this stage") from None
        if not out.requires_grad:
            pass  # a first stage without weights (a flatten, say) has nothing to back-propagate
        elif self.last:
            out.backward()
        else:
            if grad_output is None or grad_output.shape != out.shape:
                shape = None if grad_output is None else tuple(grad_output.shape)
                raise StageError(f"micro-batch {micro_batch}: gradient of shape {shape}, output {tuple(out.shape)}")
            out.backward(grad_output)
        if self.first or x.grad is None:
            return None
        return x.grad

    def warm_up(self, inputs: torch.Tensor) -> None:
        """Run one forward and backward on ``inputs`` and undo every effect (gradients, BatchNorm statistics), so
        the first real micro-batch does not pay for the allocator's and the kernels' first use. The random number
        generator is restored too, so dropout masks stay those of a run without the warm-up."""
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        x = inputs if self.first or not inputs.is_floating_point() else inputs.detach().requires_grad_(True)
        # The accelerator's generator too: dropout there draws from it, not from the CPU's.
        accelerator = [self.compute.index or 0] if self.compute.type == "cuda" else []
        with torch.random.fork_rng(devices=accelerator):
            out = self.module(x)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
        with torch.no_grad():
            for buffer, before in buffers:
                buffer.copy_(before)
        for p in self.module.parameters():
            p.grad = None

    def flat_gradients(self) -> torch.Tensor:
        """Every parameter's accumulated gradient in one flat float32 vector (zeros where there is none), in
        parameter order: what a data-parallel group sums."""
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.parameters()]
        return torch.cat(parts) if parts else torch.zeros(0, device=self.compute)

    def set_flat_gradients(self, flat: torch.Tensor) -> None:
        """Replace the accumulated gradients by ``flat`` (the group's sum). Raises StageError on a size mismatch."""
        params = list(self.parameters())
        total = sum(p.numel() for p in params)
        if flat.numel() != total:
            raise StageError(f"{flat.numel()} gradient values for {total} parameters")
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def end_round(self) -> None:
        """Forget the round's loss statistics; raises StageError if activations are still held."""
        if self._saved:
            raise StageError(f"the round ended with micro-batches {sorted(self._saved)} still waiting for backward")
        self.loss_sum = 0.0
        self.correct = 0
        self.terms = 0
        self.peak_held_bytes = 0
