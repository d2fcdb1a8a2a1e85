"""The driver entry-point lookup of the GPU copy path, against stand-in cuda-python answers (no GPU)."""

from __future__ import annotations

from typing import Any

import pytest

from raykv.core.errors import CudaError, OutOfMemoryError
from raykv.core.tiers import cuda_calls


class FakeDriver:
    """Answers ``cuGetProcAddress`` as the given cuda-python version would."""

    def __init__(self, result: tuple[Any, ...]) -> None:
        self.result = result
        self.asked: list[tuple[bytes, int]] = []

    def cuGetProcAddress(self, name: bytes, version: int, flags: int) -> tuple[Any, ...]:
        self.asked.append((name, version))
        return self.result


@pytest.mark.parametrize(
    ("result", "address"),
    [
        ((0, 0x1234, 0), 0x1234),  # cuda-python >= 12.5: (err, pointer, status)
        ((0, 0x1234), 0x1234),  # older: no status
        ((0, 0x1234, 1), 0),  # the symbol is not found at that version
        ((1, 0, 0), 0),  # the call itself failed
    ],
)
def test_proc_address_reads_every_answer_shape(
    monkeypatch: pytest.MonkeyPatch, result: tuple[Any, ...], address: int
) -> None:
    fake = FakeDriver(result)
    monkeypatch.setattr(cuda_calls, "driver", lambda: fake)
    assert cuda_calls.proc_address("cuMemcpyBatchAsync", 12080) == address
    assert fake.asked == [(b"cuMemcpyBatchAsync", 12080)]


def test_failure_names_known_and_unknown_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    class Codes:
        @staticmethod
        def CUresult(code: int) -> int:
            if code == 2:
                return code
            raise ValueError(code)

        @staticmethod
        def cuGetErrorName(code: int) -> tuple[int, bytes]:
            return 0, b"CUDA_ERROR_OUT_OF_MEMORY"

    monkeypatch.setattr(cuda_calls, "driver", lambda: Codes())
    oom = cuda_calls.failure("cuMemcpyBatchAsync (copy 3)", 2)
    assert isinstance(oom, OutOfMemoryError) and oom.cuda_error == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "copy 3" in str(oom)
    unknown = cuda_calls.failure("cuLaunchKernel", 999999)
    assert isinstance(unknown, CudaError) and unknown.cuda_error == "CUresult(999999)"
