"""tests/gpu: CUDA tests, run on the device machine (`python -m pytest tests/gpu`).

Without CUDA they are not collected at all (rather than collected and skipped)."""

import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
