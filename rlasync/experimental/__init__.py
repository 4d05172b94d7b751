"""TRL's `trl.experimental` import paths (see `rlasync.trainer`): `rlasync.experimental.async_distillation`."""
