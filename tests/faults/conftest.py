"""The fault suite reuses the integration fixtures (one Ray local cluster per session, the tiny random Llama, the
by-value pickling of a test module)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_integration_conftest", Path(__file__).parents[1] / "integration" / "conftest.py"
)
_integration = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_integration)

ray_cluster = _integration.ray_cluster
tiny_model_dir = _integration.tiny_model_dir
pickle_by_value = _integration.pickle_by_value
