"""The NVMe offload DeepSpeed JSON fixture (FIXTURE)."""

from tests.support.paths import FIXTURES

FIXTURE = str(FIXTURES / "stage3_offload_nvme.json")
