"""Shared fixtures live in tests/fixtures/; each module registers itself here.

Without CUDA, Triton kernels can only run under its interpreter, and Triton decides how to build
its own standard library (``tl.cdiv`` ...) when it is first imported — by whichever test module
or library gets there first. Setting ``TRITON_INTERPRET`` here, before any test module is
imported, makes that decision the same in every process (pytest-xdist workers included). It
changes nothing for code that does not launch Triton kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = [
    "tests.fixtures.redis_server",
    "tests.fixtures.models",
    "tests.fixtures.workers",
    "tests.fixtures.browser",
    "tests.fixtures.sentinel",
    "tests.fixtures.cluster",
]
