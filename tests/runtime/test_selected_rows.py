"""A prompt chunk's selected rows (runtime/model/transformer.py `_selected_rows`): the RoPE tables are
built once per distinct row and gathered; every key must be its row's own rope, bit for bit, at the
position (row + 1) r - 1, in float32 and float64 (the reference engine), duplicates and all."""
from types import SimpleNamespace

import pytest
import torch

from runtime.model.transformer import Model, rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_selected_key_is_its_rows_own_rope(dtype):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    n, C, r, theta = 50, 64, 4, 10000.0
    lat = torch.randn(n, C, generator=g, dtype=dtype)
    src = SimpleNamespace(r=r, latents=lambda bi: lat[bi])
    idx = torch.randint(0, n, (7, 11), generator=g)
    idx[2, 5] = idx[4, 0]                                             # the same row under two queries
    ok = torch.rand(7, 11, generator=g) > 0.2
    glob = Model._selected_rows(SimpleNamespace(cfg=SimpleNamespace(rope_theta=theta)), src, idx, ok)
    keys, vals, o = glob(1, 6)
    bi = idx[1:6]
    want = torch.stack([rope(lat[row][None], torch.tensor([(int(row) + 1) * r - 1]), theta)[0]
                        for row in bi.reshape(-1)]).view(5, 11, C)    # each row alone, its tables its own
    assert keys.dtype == dtype and torch.equal(keys, want)
    assert torch.equal(vals, lat[bi]) and torch.equal(o, ok[1:6])
