"""Weight transfer, sender side: engine-side names, the manifest, per-parameter streaming and buckets."""

from rlasync.weights.plan import (
    ManifestEntry,
    bucket_manifest,
    build_manifest,
    is_sent,
    most_common_dtype,
    stream_parameters,
    transfer_name,
)

__all__ = [
    "ManifestEntry",
    "bucket_manifest",
    "build_manifest",
    "is_sent",
    "most_common_dtype",
    "stream_parameters",
    "transfer_name",
]
