"""The one data-plane message of every collective (``edgeswarm.runtime.collectives``), whatever the workload.

A ring collective among the N peers of a job moves one slice per ring step from each peer to its right neighbour
(a direct one, for small tensors, moves each peer's vector to every other peer in one step); each slice travels
as a CollectiveTensor frame on the receiver's data topic. Training's AllReduce uses it; the workloads after it
(tensor-parallel inference, split learning) use it too, so the sender check and the retry are written once
(``edgeswarm.runtime.collective_exchange``).
"""

from __future__ import annotations

from pydantic import Field

from edgeswarm.values.limits import MAX_DEVICES, MAX_EPOCH
from edgeswarm.wire.schema import Message, Name, schema

MAX_SCOPE = (1 << 40)  # exchange scopes (rounds, requests): far beyond any job, small enough for every decoder
MAX_COLLECTIVE = (1 << 20)  # collectives of one scope (two per layer of the deepest model, with headroom)
MAX_STEP = 2 * MAX_DEVICES  # an AllReduce among N peers takes 2 (N - 1) steps


@schema("edgeswarm.collective.tensor", 1)
class CollectiveTensor(Message):
    """One ring step's slice of a collective of job ``job_id`` at plan ``epoch``; always carries a 1-D tensor.

    The collective is named by ``scope`` (the exchange scope it belongs to: training's round, say; the scope's
    waits fail and are forgotten together) and ``collective`` (which of the scope's collectives: a layer's first or
    second synchronisation, say; 0 when a scope has one). ``step`` is the ring step, ``sender`` the sender's rank in
    the ring. With ``resend`` it is the receiver asking its left neighbour for step ``step`` again (its tensor is
    empty): a step sent at QoS 0 did not arrive by the deadline.

    ``direct`` marks a frame between two members that are not ring neighbours in its direction (a direct
    collective's slice to a rank other than the sender's right neighbour, or a resend request to a rank other than
    the asker's left neighbour): the receiver then takes it from any member of the ring, still only from the node
    that holds the rank ``sender`` claims.
    """

    job_id: Name
    epoch: int = Field(ge=0, le=MAX_EPOCH)
    scope: int = Field(ge=0, le=MAX_SCOPE)
    collective: int = Field(default=0, ge=0, le=MAX_COLLECTIVE)
    step: int = Field(ge=0, lt=MAX_STEP)
    sender: int = Field(ge=0, lt=MAX_DEVICES)
    resend: bool = False
    direct: bool = False
