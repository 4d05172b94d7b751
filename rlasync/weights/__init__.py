"""Weight transfer: engine-side names, the manifest, per-parameter streaming and buckets (plan); the one transport,
chosen once from the cluster's layout, is `rlasync.weights.transport` (`choose_transport`, `make_sender`,
`make_receiver`) over the bucketed broadcast group (`rlasync.weights.broadcast.WeightGroup`, gloo or NCCL) or the
shared buckets of `rlasync.weights.ipc`; a receiver loads with `rlasync.weights.apply.load_while_pausing`."""

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
