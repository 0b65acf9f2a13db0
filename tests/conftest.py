"""Test-wide setup.

Without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1), which must be set
before triton is imported anywhere, hence here.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
