"""Weight transfer: engine-side names, the manifest, per-parameter streaming and buckets (plan); the bucketed
broadcast group over gloo or NCCL is `rlasync.weights.broadcast.WeightGroup`; the engine side of a sync is
`rlasync.weights.apply.load_while_pausing`."""

from rlasync.weights.plan import (
    ManifestEntry,
    bucket_layout,
    bucket_manifest,
    build_manifest,
    is_sent,
    most_common_dtype,
    stream_parameters,
    transfer_name,
)

__all__ = [
    "ManifestEntry",
    "bucket_layout",
    "bucket_manifest",
    "build_manifest",
    "is_sent",
    "most_common_dtype",
    "stream_parameters",
    "transfer_name",
]
