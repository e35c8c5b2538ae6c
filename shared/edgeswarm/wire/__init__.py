"""The wire format: envelopes, versioned schemas, frames, tensors and chunking (docs/wire-format.md)."""

from edgeswarm.wire.chunking import DEFAULT_CHUNK_BYTES, Reassembler, tensor_frames
from edgeswarm.wire.codec import Frame, decode, encode
from edgeswarm.wire.schema import Envelope, Message, Name, Sender, registered, resolve, schema
from edgeswarm.wire.tensor import DTYPES, TensorDescriptor, WireTensor, to_wire_array

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DTYPES",
    "Envelope",
    "Frame",
    "Message",
    "Name",
    "Reassembler",
    "Sender",
    "TensorDescriptor",
    "WireTensor",
    "decode",
    "encode",
    "registered",
    "resolve",
    "schema",
    "tensor_frames",
    "to_wire_array",
]
