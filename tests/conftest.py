import os

import pytest
import torch
from hypothesis import settings

# Hypothesis profiles. "ci" (loaded when the CI environment variable is set, as CI services and
# tools/mutate.py do): examples derived from each test's own name, no example database, so a run is
# reproducible and a failure prints the blob that replays it. "dev" (otherwise): random examples,
# remembered failures in .hypothesis/. Neither has a deadline: an interpreter run takes what it
# takes. HYPOTHESIS_PROFILE picks one by name.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
# NaN-fill the results and per-call workspaces that ops without ``out`` allocate on a GPU too
# (mkernel.ops.common.result_buffer), so that a row the kernel never writes fails a test.
os.environ.setdefault("MKERNEL_POISON", "1")

settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
