"""The chaos suite runs nodes in-process (tests/component's cluster and engines) and as
processes (tests/e2e's clusters)."""

from tests.component.conftest import torch_runners
from tests.e2e.conftest import make_cluster

__all__ = ["make_cluster", "torch_runners"]
