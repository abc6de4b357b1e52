"""PyTorch's own distributed tests (``torch/testing/_internal/distributed/distributed_test.py``, shipped in the
torch wheel) on Gloo ranks, as torch's ``test/distributed/test_distributed_spawn.py`` runs them. Not collected
by the suite: ``tests/torch_suite/run.py`` runs this file twice, with torch alone and with the shim staging
every CPU tensor, and compares the outcomes."""

import os
import sys

import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

if not dist.is_available():
    print("torch.distributed is unavailable")
    sys.exit(0)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
