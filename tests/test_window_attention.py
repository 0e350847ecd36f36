"""Block-sparse attention (models.layers.window_attention) against the dense masks of the SDPA path, on the CPU.

The blocks a :class:`BlockMask` lists are checked against the dense mask element by element (every visible pair in
a listed block, every full block wholly visible, and for masks by index no listed block wholly hidden), at the
document and window edges where a block is full or not (a query block across two documents, a key block exactly
``window`` behind), and the mask cache against a new batch's offsets that take a freed tensor's id; the layer's
``flex`` backend (flex_attention's unfused reference off CUDA) is compared in float64 with its ``sdpa`` backend for
windows shorter than, equal to and longer than the sequence, documents inside and across windows, left and inner
padding, and a cache continued across the window's edge. tests/test_window_attention_gpu.py runs the compiled
CUDA path.
"""
from __future__ import annotations

import pytest
import torch

from models.layers.attention import Attention
from models.layers.window_attention import BLOCK, index_block_mask, position_block_mask


def dense_index_mask(Q: int, KV: int, window: int | None, offsets: list[int] | None) -> torch.Tensor:
    """``[Q, KV]`` visibility by index: causal, within the window and the document."""
    L = KV - Q
    i = torch.arange(Q)[:, None] + L
    j = torch.arange(KV)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= i - j < window
    if offsets is not None:
        doc = torch.searchsorted(torch.tensor(offsets[1:]), torch.arange(KV), right=True)
        allowed &= doc[i] == doc[j]
    return allowed


def dense_position_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, window: int | None
                        ) -> torch.Tensor:
    """``[B, Q, KV]`` visibility by position, as the SDPA path builds it."""
    Q, KV = q_pos.shape[1], k_pos.shape[1]
    i = torch.arange(Q)[:, None] + KV - Q
    j = torch.arange(KV)[None, :]
    allowed = (j <= i)[None] & k_valid[:, None, :]
    if window is not None:
        allowed &= q_pos[:, :, None] - k_pos[:, None, :] < window
    return allowed | (j == i)[None]


def listed(bm, full: bool) -> torch.Tensor:  # noqa: ANN001
    """``[B, Qb, KVb]``: the blocks the mask lists as partial (``full=False``) or full."""
    num, idx = (bm.full_kv_num_blocks, bm.full_kv_indices) if full else (bm.kv_num_blocks, bm.kv_indices)
    B, _, Qb, KVb = bm.kv_indices.shape
    out = torch.zeros(B, Qb, KVb, dtype=torch.bool)
    if num is None:
        return out
    for b in range(num.shape[0]):
        for m in range(Qb):
            out[b, m, idx[b, 0, m, : num[b, 0, m]].long()] = True
    return out


def check_blocks(bm, allowed: torch.Tensor, exact: bool) -> None:  # noqa: ANN001
    """Every visible pair lies in a listed block and full blocks are wholly visible; when ``exact``, no listed block
    is wholly hidden and no whole block wholly visible is left partial. ``allowed [B, Q, KV]``."""
    B, Q, KV = allowed.shape
    Qb, KVb = -(-Q // BLOCK), -(-KV // BLOCK)
    pad = torch.zeros(B, Qb * BLOCK, KVb * BLOCK, dtype=torch.bool)
    pad[:, :Q, :KV] = allowed
    per_block = pad.view(B, Qb, BLOCK, KVb, BLOCK)
    any_visible, count = per_block.any(4).any(2), per_block.sum((2, 4))
    whole = torch.zeros(B, Qb, KVb, dtype=torch.long)
    for m in range(Qb):
        for n in range(KVb):
            whole[:, m, n] = (min(Q, (m + 1) * BLOCK) - m * BLOCK) * (min(KV, (n + 1) * BLOCK) - n * BLOCK)
    part, full = listed(bm, False), listed(bm, True)
    part, full = part.expand(B, -1, -1), full.expand(B, -1, -1)
    assert not (part & full).any(), "a block listed both partial and full"
    assert not (any_visible & ~(part | full)).any(), "a visible pair in a block that is never computed"
    assert (count[full] == whole[full]).all(), "a block marked full hides some pair"
    if exact:
        assert any_visible[part].all(), "a listed block that hides every pair"
        # ragged edge blocks stay partial (the mask bounds them); whole blocks wholly visible are full
        assert (count[part & (whole == BLOCK * BLOCK)] < BLOCK * BLOCK).all(), "a wholly visible block left partial"


@pytest.mark.parametrize("Q,KV,window,offsets", [
    (300, 300, 64, None),  # window shorter than the sequence, lengths off the block size
    (256, 256, 256, None),  # window equal to the sequence
    (256, 256, 1000, None),  # window longer than the sequence
    (512, 512, 200, [0, 90, 300, 301, 512]),  # documents inside and across windows, one of one token
    (640, 640, None, [0, 128, 250, 640]),  # documents, no window
    (200, 520, 300, None),  # queries after 320 earlier keys (the window's edge inside the prefix)
])
def test_index_blocks_cover_the_mask_exactly(Q: int, KV: int, window: int | None, offsets: list[int] | None) -> None:
    cu = None if offsets is None else torch.tensor(offsets)
    bm = index_block_mask(Q, KV, window, cu, torch.device("cpu"))
    check_blocks(bm, dense_index_mask(Q, KV, window, offsets)[None], exact=True)


@pytest.mark.parametrize("Q,KV,window,offsets", [
    (384, 384, None, [0, 200, 384]),  # query block 1 spans two documents; key block 0 lies wholly in the first
    (384, 384, 300, [0, 200, 384]),  # the same inside a window
    (512, 512, 255, None),  # key block n is exactly the window behind block n + 1's last query
    (2048, 2048, 1023, None),  # ... 8 blocks behind
    (4096, 4096, 2047, None),  # ... 16 blocks behind
    (3072, 4096, 2047, [0, 1000, 4096]),  # the same after 1024 earlier keys, a document across the window's edge
])
def test_full_blocks_at_document_and_window_edges(Q: int, KV: int, window: int | None, offsets: list[int] | None
                                                  ) -> None:
    """A block is full (no mask applied) only when every pair in it is visible: not when its query block spans two
    documents, nor when the key block's first key is exactly ``window`` behind the query block's last query (windows
    of 127 mod 128 put that edge on a block boundary)."""
    cu = None if offsets is None else torch.tensor(offsets)
    bm = index_block_mask(Q, KV, window, cu, torch.device("cpu"))
    allowed = dense_index_mask(Q, KV, window, offsets)[None]
    check_blocks(bm, allowed, exact=True)
    full = listed(bm, True)[0]
    if window is not None and offsets is None:  # the block one further in is full: the edge is exact, not avoided
        m = Q // BLOCK - 1  # the last query block; key block n starts exactly `window` behind its last query
        n = (KV - Q + m * BLOCK + BLOCK - 1 - window) // BLOCK
        assert n * BLOCK == KV - Q + m * BLOCK + BLOCK - 1 - window and not full[m, n]
        assert n + 1 == (KV - Q) // BLOCK + m or full[m, n + 1]  # the next one is full unless it is the diagonal


def padded_positions(valid: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    v = valid.long()
    return start[:, None] + v.cumsum(1) - v


@pytest.mark.parametrize("window", [50, 130, None])
def test_position_blocks_cover_the_mask(window: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    B, L, T = 3, 200, 333
    valid = torch.rand(B, L + T, generator=g) > 0.3  # inner padding: positions advance slower than indices
    valid[0, :150] = False  # left padding
    k_pos = padded_positions(valid, torch.tensor([0, 5, 17]))
    q_pos, q_valid = k_pos[:, L:], valid
    bm = position_block_mask(q_pos, k_pos, q_valid, window)
    check_blocks(bm, dense_position_mask(q_pos, k_pos, q_valid, window), exact=False)


def layer_pair(window: int | None, seed: int = 0) -> tuple[Attention, Attention]:
    torch.manual_seed(seed)
    ref = Attention(64, 4, 16, window=window, layer_idx=0, backend="sdpa").double()
    flex = Attention(64, 4, 16, window=window, layer_idx=0, backend="flex").double()
    flex.load_state_dict(ref.state_dict())
    return ref, flex


def test_flex_backend_refuses_gradients_off_cuda() -> None:
    _, flex = layer_pair(64)
    with pytest.raises(RuntimeError, match="no backward on cpu"):
        flex(torch.randn(1, 200, 64, dtype=torch.float64))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("T,window", [(300, 64), (256, 256), (200, 1000), (260, 129)])
@torch.no_grad()
def test_layer_windows_equal_sdpa(T: int, window: int) -> None:
    ref, flex = layer_pair(window)
    x = torch.randn(2, T, 64, dtype=torch.float64)
    assert rel(flex(x)[0], ref(x)[0]) < 1e-12


@torch.no_grad()
def test_layer_documents_equal_sdpa() -> None:
    ref, flex = layer_pair(100)
    x = torch.randn(1, 400, 64, dtype=torch.float64)
    cu = torch.tensor([0, 37, 180, 181, 400])  # a document shorter than the window, one across it, one token
    assert rel(flex(x, cu_seqlens=cu)[0], ref(x, cu_seqlens=cu)[0]) < 1e-12
    full_ref, full_flex = layer_pair(None)
    assert rel(full_flex(x, cu_seqlens=cu)[0], full_ref(x, cu_seqlens=cu)[0]) < 1e-12


@torch.no_grad()
def test_layer_padding_equals_sdpa() -> None:
    ref, flex = layer_pair(90)
    x = torch.randn(3, 300, 64, dtype=torch.float64)
    mask = torch.ones(3, 300, dtype=torch.long)
    mask[0, :170] = 0  # left padding
    mask[1, 40:60] = 0  # inner padding
    out_f, out_r = flex(x, attention_mask=mask)[0], ref(x, attention_mask=mask)[0]
    real = mask.bool()
    assert rel(out_f[real], out_r[real]) < 1e-12
    assert rel(out_f, out_r) < 1e-12  # padded queries see themselves in both


@torch.no_grad()
def test_prefill_continued_across_the_window_edge_equals_sdpa() -> None:
    from kdn.layers import RecurrentCache

    ref, flex = layer_pair(150)
    x = torch.randn(2, 420, 64, dtype=torch.float64)
    mask = torch.ones(2, 420, dtype=torch.long)
    mask[1, :60] = 0
    caches = {}
    for name, layer in (("ref", ref), ("flex", flex)):
        cache = RecurrentCache()
        o1 = layer(x[:, :200], attention_mask=mask[:, :200], past_key_values=cache, use_cache=True)[0]
        o2 = layer(x[:, 200:], attention_mask=mask, past_key_values=cache, use_cache=True)[0]
        caches[name] = (torch.cat([o1, o2], 1), cache.get(0))
    assert rel(caches["flex"][0], caches["ref"][0]) < 1e-12
    whole = ref(x, attention_mask=mask)[0]
    assert rel(caches["flex"][0][mask.bool()], whole[mask.bool()]) < 1e-12
    for key in ("k", "v", "pos", "valid", "next_pos"):
        assert torch.equal(caches["flex"][1][key], caches["ref"][1][key]), key


@torch.no_grad()
def test_packed_prefill_equals_sdpa() -> None:
    ref, flex = layer_pair(80)
    x = torch.randn(1, 350, 64, dtype=torch.float64)
    cu = torch.tensor([0, 50, 260, 350])
    o_ref, _, c_ref = ref(x, cu_seqlens=cu, use_cache=True)
    o_flex, _, c_flex = flex(x, cu_seqlens=cu, use_cache=True)
    assert rel(o_flex, o_ref) < 1e-12
    for key in ("k", "v", "pos", "valid", "next_pos"):
        assert torch.equal(c_flex.get(0)[key], c_ref.get(0)[key]), key


def test_masks_of_a_batch_are_built_once() -> None:
    from models.layers.window_attention import block_mask_for

    cu = torch.tensor([0, 100, 300])
    a = block_mask_for(300, 300, 64, cu_seqlens=cu, device=torch.device("cpu"))
    assert block_mask_for(300, 300, 64, cu_seqlens=cu, device=torch.device("cpu")) is a
    other = torch.tensor([0, 100, 300])  # equal values, another batch: never served a mask made for another tensor
    assert block_mask_for(300, 300, 64, cu_seqlens=other, device=torch.device("cpu")) is not a
    cu[1] = 120  # changed in place: rebuilt
    assert block_mask_for(300, 300, 64, cu_seqlens=cu, device=torch.device("cpu")) is not a
    plain = block_mask_for(300, 300, 64, device=torch.device("cpu"))
    assert block_mask_for(300, 300, 64, device=torch.device("cpu")) is plain


def test_a_new_batch_whose_offsets_reuse_a_freed_tensors_id_gets_its_own_mask(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    """CPython gives a new object the address (``id``) of a freed one; every tensor here shares one id, so the cache
    can tell a new batch's ``cu_seqlens`` from the freed one's only by the tensor it holds a weak reference to."""
    from models.layers import window_attention
    from models.layers.window_attention import block_mask_for

    monkeypatch.setattr(window_attention, "id", lambda obj: 12345, raising=False)
    monkeypatch.setattr(window_attention, "_masks", type(window_attention._masks)())
    dev = torch.device("cpu")
    old = torch.tensor([0, 100, 300])
    stale = block_mask_for(300, 300, 64, cu_seqlens=old, device=dev)
    del old  # freed: a new batch may take its address
    new = torch.tensor([0, 250, 300])  # same id, same version (0), other documents
    mask = block_mask_for(300, 300, 64, cu_seqlens=new, device=dev)
    assert mask is not stale
    check_blocks(mask, dense_index_mask(300, 300, 64, [0, 250, 300])[None], exact=True)
    assert block_mask_for(300, 300, 64, cu_seqlens=new, device=dev) is mask  # and is then reused for its layers


def test_backend_is_checked() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        Attention(64, 4, 16, window=None, backend="flash")
