"""BlockCopier without an engine: engine blocks -> pages -> other engine blocks is bit-exact for
both page layouts, in runs and scattered; the token-major pages hold each token's K and V where
the HF adapter reads them; bad inputs raise typed errors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from raykv import InvalidArgumentError  # noqa: E402
from raykv.integrations.vllm.layout import BlockCopier, layer_index, native_layout  # noqa: E402
from raykv.integrations.vllm.testing import tiny_layout  # noqa: E402

NAMES = [f"model.layers.{i}.self_attn.attn" for i in (1, 0)]  # out of order on purpose


def _caches(seed: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(12, 2, 32, 128, generator=gen) for n in NAMES}


@pytest.mark.parametrize("native", [False, True])
def test_round_trip_exact(native: bool) -> None:
    layout = native_layout(2, 2, 64, 32, "float32") if native else tiny_layout()
    names = sorted(NAMES, key=layer_index)
    src, dst = _caches(1), _caches(2)
    ids, into = [3, 4, 5, 9, 1], [0, 1, 2, 7, 11]
    rows = np.zeros((len(ids), layout.page_bytes), dtype=np.uint8)
    BlockCopier(layout, names, src).save(ids, rows)
    BlockCopier(layout, names, dst).load(rows, into)
    for name in names:
        assert torch.equal(dst[name][into], src[name][ids])  # type: ignore[index]
    if not native:  # token t of block 3, layer 0, head 1: K is the first head_size values of the row
        region = layout.buffer_region(0, "k")
        k = rows[0, region.offset : region.offset + region.nbytes].view(np.float32).reshape(32, 2, 64)
        engine = src[names[0]].view(12, 2, 64, 64)  # type: ignore[attr-defined]
        assert np.array_equal(k[5, 1], engine[3, 1, 5].numpy())


def test_bad_inputs_raise_typed_errors() -> None:
    layout = tiny_layout()
    names = sorted(NAMES, key=layer_index)
    copier = BlockCopier(layout, names, _caches(1))
    with pytest.raises(InvalidArgumentError):
        copier.load(np.zeros((1, layout.page_bytes), np.uint8), [12])
    with pytest.raises(InvalidArgumentError):
        copier.save([0], np.zeros((1, 10), np.uint8))
    with pytest.raises(InvalidArgumentError):
        BlockCopier(layout, names[:1], _caches(1))
    with pytest.raises(InvalidArgumentError):
        BlockCopier(native_layout(2, 2, 64, 16, "float32"), names, _caches(1))
