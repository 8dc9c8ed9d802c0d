"""RoPE + MQA over a slotted KV cache (split-key kernel) + inverse RoPE vs the torch reference."""

import pytest
import torch

from fp8chain.verify import rotated_rows_error
from fp8chain_kernel import reference as ref
from fp8chain_kernel.attention import _pipeline_stages, _split_tile, key_splits, mqa_attention, rope_qkv
from fp8chain_kernel.launch import H200_SMS

ROPE_DIM = 64
THETA = 10000.0


def _problem(tokens, heads, dim, length, slots_count, device, positions=None):
    q = torch.randn(tokens, heads, dim, device=device)
    q = (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True))).bfloat16()  # normed, as rope_qkv writes them
    kv_cache = torch.randn(slots_count, length, dim, device=device).bfloat16()
    slots = torch.randint(0, slots_count, (tokens,), device=device)
    if positions is None:
        positions = torch.randint(0, length, (tokens,), device=device)
    sink = torch.randn(heads, device=device)
    cos, sin = ref.rope_tables(length, ROPE_DIM, THETA, device)
    return q, kv_cache, slots, positions, sink, dim ** -0.5, cos, sin


def _assert_attention_close(got, problem):
    """``got`` within the kernel's rounding of the fp32 reference, elementwise:
    1 bf16 ulp of the output + 2^-8 * sum_l p_l |v_l| / denom (the probabilities are rounded to
    bf16 for ``p @ v``, relative error <= 2^-9 each; fp32 reordering is far below that). The
    inverse RoPE mixes each pair, so a rotated element's allowance is its pair's sum."""
    q, kv_cache, slots, positions, sink, scale, cos, sin = problem
    keys = kv_cache[slots].float()
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] <= positions[:, None]
    o = ref.attention_with_sinks(q.float(), keys, valid, sink, scale)
    d = q.shape[-1]
    rotate = lambda x: torch.cat([x[..., :d - ROPE_DIM], ref.apply_rope(  # noqa: E731
        x[..., d - ROPE_DIM:], cos[positions], sin[positions], inverse=True)], dim=-1)
    want = rotate(o)
    scores = torch.einsum("thd,tld->thl", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    peak = torch.maximum(scores.amax(-1, keepdim=True), sink.view(1, -1, 1))
    probs = torch.exp(scores - peak)
    probs = probs / (probs.sum(-1, keepdim=True) + torch.exp(sink.view(1, -1, 1) - peak))
    magnitude = torch.einsum("thl,tld->thd", probs, keys.abs())
    pairs = magnitude[..., d - ROPE_DIM:].unflatten(-1, (-1, 2)).sum(-1, keepdim=True).expand(-1, -1, -1, 2)
    magnitude = torch.cat([magnitude[..., :d - ROPE_DIM], pairs.flatten(-2)], dim=-1)
    assert torch.isfinite(got).all(), "non-finite values in output"
    err = (got.float() - want).abs()
    allowed = want.abs() * 2.0**-7 + magnitude * 2.0**-8
    worst = (err / allowed).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the allowed bound"
    assert torch.equal(ref.mqa_attention(*problem), want.bfloat16())


@pytest.mark.cpu
@pytest.mark.parametrize("tokens,heads,dim,length", [(3, 17, 96, 160), (1, 64, 512, 1024)])
def test_reference_with_bf16_products(tokens, heads, dim, length):
    """``matmul_dtype=bf16`` (the compiled peer's attention): bf16 scores and probabilities, so
    within a few bf16 roundings of the fp32 specification, not equal to it."""
    problem = _problem(tokens, heads, dim, length, 2, "cpu")
    want = ref.mqa_attention(*problem).float()
    got = ref.mqa_attention(*problem, matmul_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    err = (got.float() - want).abs()
    assert (err <= 2.0**-4 * (want.abs() + want.abs().mean())).all()
    assert not torch.equal(got.float(), want)


def _check_attention(problem, tile=None):
    q = problem[0]
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)  # poisoned
    got = mqa_attention(*problem, out=out, tile=tile)
    assert got.data_ptr() == out.data_ptr()
    _assert_attention_close(got, problem)


@pytest.mark.cpu
@pytest.mark.parametrize("tokens,heads,dim,length", [(1, 2, 128, 16), (3, 17, 96, 160), (5, 16, 128, 50)])
def test_attention_matches_reference_cpu(tokens, heads, dim, length):
    _check_attention(_problem(tokens, heads, dim, length, 3, "cpu"))


@pytest.mark.cpu
def test_many_tokens_merge_in_column_chunks():
    """48 tokens x 4 merge head blocks fill 132 SMs: the keys still split in two (48 x 2 split
    programs of 64 heads), and the merge runs 16-column programs (168 columns: the last chunk is
    partly masked)."""
    assert key_splits(48, 64, 256) == 2
    _check_attention(_problem(48, 64, 168, 256, 4, "cpu"))


@pytest.mark.cpu
@pytest.mark.parametrize("tile,length", [((32, 32), 256), ((64, 64), 256), ((64, 16), 16)],
                         ids=["split", "wide-split", "one-split"])
def test_other_split_tiles(tile, length):
    """Wider head tiles and shorter key steps (tile=): keys split over several programs (merged), or
    one program per token's keys."""
    assert (key_splits(2, 64, length, tile) > 1) == (length == 256)
    problem = _problem(2, 64, 128, length, 2, "cpu", positions=torch.tensor([length - 1, length // 3]))
    out = torch.full(problem[0].shape, float("nan"), dtype=torch.bfloat16)
    _assert_attention_close(mqa_attention(*problem, out=out, tile=tile), problem)
    with pytest.raises(ValueError, match="tile"):
        mqa_attention(*problem, tile=(48, 32))


@pytest.mark.cpu
def test_one_split_writes_the_output_itself():
    """Enough (token, head block) programs to fill the GPU: one split per token, which applies the
    sink, the normalisation and the inverse RoPE itself (no partials, no merge launch)."""
    assert key_splits(17, 256, 300, (16, 64)) == 1
    _check_attention(_problem(17, 256, 64, 300, 5, "cpu"), tile=(16, 64))


@pytest.mark.cpu
@pytest.mark.parametrize("tokens,heads,length,tile", [
    (1, 64, 1024, (16, 64)), (15, 64, 1024, (16, 64)), (16, 64, 1024, (32, 64)), (32, 64, 1024, (32, 64)),
    (64, 64, 1024, (64, 64)), (16, 64, 4096, (64, 64)), (256, 64, 1024, (64, 64)), (264, 64, 1024, (64, 64)),
    (265, 64, 1024, (64, 64)), (2048, 64, 2048, (64, 64)), (2048, 16, 2048, (16, 64)), (64, 16, 1024, (16, 64)),
    (256, 32, 1024, (32, 64)), (3, 8, 64, (16, 64)),
    (33, 64, 1024, (32, 64)), (34, 64, 1024, (64, 64)), (40, 64, 512, (64, 64)), (48, 64, 256, (64, 64)),
    (56, 64, 1024, (64, 64)), (66, 64, 64, (32, 64)), (67, 64, 64, (64, 64)),
])
def test_default_split_tile_by_query_rows(tokens, heads, length, tile):
    """16 heads x 64 keys per program below 1024 (token, head) rows, 32 x 64 from there, 64 x 64
    from 64K (token, key) pairs of 64 heads (split or not: prefill too), as measured on the H200
    (docs/benchmarks.md), and below 64K pairs wherever the 32 x 64 tile's split programs would not
    fit in one wave of the 132 SMs (34 tokens with two key splits; 67 with one step of keys);
    never more heads per program than the layer has (a TP4 shard's 16 heads keep 16 x 64)."""
    assert _split_tile(None, tokens, heads, length, H200_SMS) == tile


@pytest.mark.cpu
@pytest.mark.parametrize("tile,stages", [((16, 64), 3), ((32, 64), 3), ((64, 32), 3), ((64, 64), 2)])
def test_split_kernel_pipeline_depth_fits_shared_memory(tile, stages):
    """Three key tiles in flight where they fit beside the query tile (D = 512, bf16), else two."""
    assert _pipeline_stages(*tile, 512) == stages


@pytest.mark.cpu
@pytest.mark.parametrize("tile", [(8, 64), (64, 8), (16, 24)])
def test_split_tiles_below_16_or_not_powers_of_two_are_refused(tile):
    """``tile=``: each side a power of two >= 16 (tl.dot's smallest operand), refused otherwise by
    ``key_splits`` and ``mqa_attention`` alike, before any launch."""
    with pytest.raises(ValueError, match="tile"):
        key_splits(1, 16, 64, tile)
    problem = _problem(1, 16, 64, 64, 1, "cpu")
    with pytest.raises(ValueError, match="tile"):
        mqa_attention(*problem, tile=tile)


class _Launches:
    """Stands in for a Triton kernel: records each launch's grid and constexprs, runs nothing."""

    def __init__(self):
        self.grids, self.consts = [], []

    def __getitem__(self, grid):
        def launch(*args, **consts):
            self.grids.append(tuple(grid))
            self.consts.append(consts)
        return launch


@pytest.mark.cpu
@pytest.mark.parametrize("tokens,heads,length", [(16, 64, 4096), (1, 16, 1024), (300, 64, 1024), (48, 64, 256)])
def test_default_launch_is_the_tile_and_splits_key_splits_reports(tokens, heads, length, monkeypatch):
    """By default ``mqa_attention`` launches ``_split_tile``'s tile (chosen by the cache length L)
    and ``key_splits``' count for that tile; the merge (only where keys split) covers every
    16-head block and every column."""
    from fp8chain_kernel import attention

    split, merge = _Launches(), _Launches()
    monkeypatch.setattr(attention, "_mqa_split_kernel", split)
    monkeypatch.setattr(attention, "_mqa_merge_kernel", merge)
    dim = 64
    mqa_attention(*_problem(tokens, heads, dim, length, 1, "cpu"))
    block_h, block_l = _split_tile(None, tokens, heads, length, H200_SMS)
    splits = key_splits(tokens, heads, length)
    assert split.grids == [(tokens, -(-heads // block_h), splits)]
    assert (split.consts[0]["BLOCK_H"], split.consts[0]["BLOCK_L"], split.consts[0]["SPLITS"]) == \
        (block_h, block_l, splits)
    assert split.consts[0]["STEPS"] * splits * block_l >= length  # every key in some split
    if splits == 1:
        assert merge.grids == []
    else:
        (t, head_blocks, chunks), = merge.grids
        assert (t, head_blocks, merge.consts[0]["SPLITS"]) == (tokens, -(-heads // 16), splits)
        assert chunks * merge.consts[0]["BLOCK_C"] >= dim


@pytest.mark.cpu
@pytest.mark.parametrize("heads,tokens,length,splits", [
    (64, 1, 1024, 16), (16, 1, 1024, 16), (16, 4, 1024, 16), (64, 4, 1024, 8), (64, 16, 1024, 4),
    (64, 32, 1024, 2), (64, 64, 1024, 2), (64, 256, 1024, 2),
    (64, 1, 4096, 16), (64, 4, 4096, 8), (64, 16, 4096, 8), (16, 64, 1024, 2), (16, 16, 4096, 8),
    (64, 2048, 2048, 1), (16, 300, 1024, 1),
    (16, 264, 1024, 2), (16, 265, 1024, 1),  # 264 programs = two waves: still 2 splits; one more: 1
])
def test_key_splits_by_batch(heads, tokens, length, splits):
    """The split counts the H200 sweep found fastest (docs/benchmarks.md): one wave of split
    programs, at least two splits while the unsplit programs fit in two waves, at most 16 and one
    per step of 64 keys."""
    assert key_splits(tokens, heads, length) == splits


@pytest.mark.cpu
@pytest.mark.parametrize("splits", [1, 3])
def test_explicit_key_splits(splits):
    """``splits=`` overrides the count (the benchmark's sweep): one program per token's keys, or
    three (the last with fewer keys); out of range is an error."""
    problem = _problem(2, 16, 128, 320, 2, "cpu", positions=torch.tensor([319, 100]))
    out = torch.full(problem[0].shape, float("nan"), dtype=torch.bfloat16)
    _assert_attention_close(mqa_attention(*problem, out=out, splits=splits), problem)
    for bad in (0, 6, 2.0, True):
        with pytest.raises(ValueError, match="splits"):
            mqa_attention(*problem, splits=bad)


@pytest.mark.cpu
def test_most_key_splits_the_merge_takes():
    """256 splits (a merge program then holds one column pair) are merged; 257 are refused before
    any launch, whatever the key steps allow (here 544 steps of 16 keys)."""
    problem = _problem(1, 4, 128, 8704, 1, "cpu", positions=torch.tensor([8703]))
    out = torch.full(problem[0].shape, float("nan"), dtype=torch.bfloat16)
    _assert_attention_close(mqa_attention(*problem, out=out, tile=(16, 16), splits=256), problem)
    for bad in (257, 544):
        with pytest.raises(ValueError, match="at most 256"):
            mqa_attention(*problem, tile=(16, 16), splits=bad)


@pytest.mark.cpu
def test_key_splits_are_merged():
    """A shape whose keys are split over several programs (merge path, empty splits included)."""
    assert key_splits(2, 4, 256) > 1
    positions = torch.tensor([3, 255])  # the first token's later splits see no key at all
    _check_attention(_problem(2, 4, 128, 256, 2, "cpu", positions=positions))


@pytest.mark.cpu
def test_many_key_splits_are_merged():
    """10 key splits per token, the second token's later splits without any key."""
    assert key_splits(2, 4, 640) == 10
    _check_attention(_problem(2, 4, 128, 640, 2, "cpu", positions=torch.tensor([639, 300])))


@pytest.mark.cpu
@pytest.mark.parametrize("length,tile", [(256, None), (64, (16, 64))], ids=["split-merge", "one-split"])
def test_nan_reaches_only_its_readers(length, tile):
    """A NaN in one query head makes that head's output NaN and nothing else; a NaN cache row makes
    every head of the tokens that attend to it NaN, while a token of that slot whose position is
    before the row, and the other slots' tokens, keep their clean outputs bit for bit (a stale NaN in
    a reused slot must not reach a new sequence). The kernel and the reference alike."""
    problem = list(_problem(3, 4, 128, length, 2, "cpu", positions=torch.tensor([length - 1, 10, 40])))
    problem[2] = torch.tensor([0, 1, 1])
    for attend in (lambda *p: mqa_attention(*p, tile=tile), ref.mqa_attention):
        clean = attend(*problem)
        assert torch.isfinite(clean.float()).all()
        with_nan_q = list(problem)
        with_nan_q[0] = problem[0].clone()
        with_nan_q[0][1, 2, 5] = float("nan")
        got = attend(*with_nan_q)
        assert torch.isnan(got[1, 2]).all()
        others = torch.ones(3, 4, dtype=torch.bool)
        others[1, 2] = False
        assert torch.equal(got[others], clean[others])
        with_nan_row = list(problem)
        with_nan_row[1] = problem[1].clone()
        with_nan_row[1][1, 30] = float("nan")  # slot 1, position 30: read by token 2 (40), not token 1 (10)
        got = attend(*with_nan_row)
        assert torch.isnan(got[2]).all()
        assert torch.equal(got[:2], clean[:2])


def _check_out_of_range_indices(device, length=256, tile=None, index_dtype=torch.int64):
    """Tokens whose slot or position is out of range (-1, S / L, far either way): ``rope_qkv`` writes
    no cache row for them and NaN query rows, ``mqa_attention`` reads none and gives them NaN; the
    other tokens get exactly what they get with every index in range. The cache sits between guard
    slots of one buffer, so a write one slot or one row outside it would show; a read far outside
    it would fault."""
    slots_count, heads, dim = 3, 4, 128
    far = 1 << (40 if index_dtype == torch.int64 else 30)
    bad = [(-1, 5), (slots_count, 5), (far, 5), (-far, 5), (1, -1), (1, length), (0, far), (2, -far)]
    tokens = len(bad) + 3
    buffer = torch.randn(slots_count + 2, length, dim, device=device).bfloat16()
    kv_cache = buffer[1:1 + slots_count]
    good_slots = torch.tensor([0, 1, 2] * 4, device=device, dtype=index_dtype)[:tokens]
    good_positions = torch.arange(tokens, device=device, dtype=index_dtype) * 5
    slots, positions = good_slots.clone(), good_positions.clone()
    for t, (slot, position) in enumerate(bad):
        slots[t], positions[t] = slot, position
    is_bad = torch.arange(tokens, device=device) < len(bad)
    q = torch.randn(tokens, heads * dim, device=device).bfloat16()
    kv = torch.randn(tokens, dim, device=device).bfloat16()
    cos, sin = ref.rope_tables(length, ROPE_DIM, THETA, device)
    before = buffer.clone()
    roped = rope_qkv(q, kv, cos, sin, kv_cache, slots, positions, 1e-6)
    assert torch.isnan(roped[is_bad].float()).all()
    written = torch.zeros(buffer.shape[:2], dtype=torch.bool, device=device)
    written[good_slots[~is_bad] + 1, good_positions[~is_bad]] = True
    assert torch.equal(buffer[~written], before[~written])
    clean_cache = before[1:1 + slots_count].clone()
    clean = rope_qkv(q, kv, cos, sin, clean_cache, good_slots, good_positions, 1e-6)
    assert torch.equal(roped[~is_bad], clean[~is_bad])
    assert torch.equal(kv_cache[written[1:1 + slots_count]], clean_cache[written[1:1 + slots_count]])

    sink = torch.randn(heads, device=device)
    attention = lambda s, p: mqa_attention(roped, buffer[1:1 + slots_count], s, p, sink, dim ** -0.5,  # noqa: E731
                                           cos, sin, tile=tile)
    got, want = attention(slots, positions), attention(good_slots, good_positions)
    assert torch.isnan(got[is_bad].float()).all()
    assert torch.isfinite(want[~is_bad].float()).all() and torch.equal(got[~is_bad], want[~is_bad])
    with pytest.raises(IndexError):
        ref.mqa_attention(roped, kv_cache, slots, positions, sink, dim ** -0.5, cos, sin)


@pytest.mark.cpu
@pytest.mark.parametrize("length,tile", [(256, None), (64, (16, 64))], ids=["split-merge", "one-split"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_out_of_range_indices_write_nothing_and_give_nan(length, tile, index_dtype):
    assert (key_splits(11, 4, length, tile) > 1) == (tile is None)
    _check_out_of_range_indices("cpu", length, tile, index_dtype)


@pytest.mark.cpu
def test_prefill_positions_and_a_heavy_sink():
    """Causal prefill of one slot (positions 0..T-1, position 0 sees one key) and the sink."""
    tokens = 7
    problem = list(_problem(tokens, 4, 128, 128, 1, "cpu", positions=torch.arange(tokens)))
    _check_attention(tuple(problem))
    problem[4] = torch.full((4,), 30.0)  # a sink that takes almost all the mass
    _check_attention(tuple(problem))


def _assert_rounded_alike(got, want):
    """Two bf16 roundings of one fp32 computation done in different orders
    (``verify.rotated_rows_error``: 1 bf16 ulp of ``want`` and 2^-16 of its row's largest value)."""
    assert torch.isfinite(got.float()).all(), "non-finite values in output"
    worst = rotated_rows_error(got, want)
    assert worst <= 1.0, f"error {worst:.2f}x the allowed bound"


def _check_rope(tokens, heads, dim, length, device, kv_norm=False):
    q = torch.randn(tokens, heads * dim, device=device).bfloat16()
    kv = (torch.randn(tokens, dim, device=device) * (3.0 if kv_norm else 1.0)).bfloat16()
    kv_weight = torch.rand(dim, device=device).add(0.5).bfloat16() if kv_norm else None
    slots = torch.randperm(tokens, device=device)
    positions = torch.randint(0, length, (tokens,), device=device)
    cos, sin = ref.rope_tables(length, ROPE_DIM, THETA, device)
    cache = torch.randn(tokens, length, dim, device=device).bfloat16()
    want_cache = cache.clone()
    got = rope_qkv(q, kv, cos, sin, cache, slots, positions, 1e-6, kv_weight=kv_weight)
    want = ref.rope_qkv(q, kv, cos, sin, want_cache, slots, positions, 1e-6, kv_weight=kv_weight)
    assert got.shape == (tokens, heads, dim) and got.dtype == torch.bfloat16
    _assert_rounded_alike(got, want)
    _assert_rounded_alike(cache[slots, positions], want_cache[slots, positions])
    untouched = torch.ones(cache.shape[:2], dtype=torch.bool, device=device)
    untouched[slots, positions] = False
    assert torch.equal(cache[untouched], want_cache[untouched])


@pytest.mark.cpu
@pytest.mark.parametrize("tokens,heads,dim", [(1, 2, 128), (3, 17, 96), (4, 16, 512)])
def test_rope_qkv_matches_reference_cpu(tokens, heads, dim):
    _check_rope(tokens, heads, dim, 32, "cpu")


@pytest.mark.cpu
def test_rope_qkv_head_or_latent_whose_sum_of_squares_overflows_is_nan():
    """A query head or a raw latent of finite values whose sum of squares overflows fp32 is
    normed to NaN, not zeros (the reference's rms_rsqrt); the other heads and tokens are not."""
    tokens, heads, dim = 3, 4, 128
    q = torch.randn(tokens, heads * dim).bfloat16()
    kv = torch.randn(tokens, dim).bfloat16()
    weight = torch.rand(dim).add(0.5).bfloat16()
    cos, sin = ref.rope_tables(32, ROPE_DIM, THETA, "cpu")
    slots, positions = torch.arange(tokens), torch.tensor([3, 9, 31])
    q[1, 2 * dim:3 * dim] *= 1e20   # token 1, head 2
    kv[2] *= 1e20                   # token 2's latent
    cache = torch.randn(tokens, 32, dim).bfloat16()
    want_cache = cache.clone()
    got = rope_qkv(q, kv, cos, sin, cache, slots, positions, 1e-6, kv_weight=weight)
    want = ref.rope_qkv(q, kv, cos, sin, want_cache, slots, positions, 1e-6, kv_weight=weight)
    for out in (got, want):
        assert torch.isnan(out[1, 2]).all()
        assert torch.isfinite(out[1, [0, 1, 3]].float()).all() and torch.isfinite(out[[0, 2]].float()).all()
    for c in (cache, want_cache):
        assert torch.isnan(c[2, 31]).all() and torch.isfinite(c[[0, 1], [3, 9]].float()).all()


@pytest.mark.cpu
@pytest.mark.parametrize("tokens,dim", [(1, 128), (5, 96)])
def test_rope_qkv_normalizes_the_raw_latent(tokens, dim):
    """kv_weight: the kv RMSNorm runs inside rope_qkv; its bf16 rounding is rms_norm's, so the
    cached latent is what rms_norm followed by rope_qkv writes."""
    _check_rope(tokens, 4, dim, 32, "cpu", kv_norm=True)
    q = torch.randn(tokens, 4 * dim).bfloat16()
    kv = torch.randn(tokens, dim).bfloat16()
    weight = torch.rand(dim).add(0.5).bfloat16()
    cos, sin = ref.rope_tables(32, ROPE_DIM, THETA, "cpu")
    slots, positions = torch.arange(tokens), torch.randint(0, 32, (tokens,))
    fused = torch.randn(tokens, 32, dim).bfloat16()
    split = fused.clone()
    rope_qkv(q, kv, cos, sin, fused, slots, positions, 1e-6, kv_weight=weight)
    rope_qkv(q, ref.rms_norm(kv, weight, 1e-6), cos, sin, split, slots, positions, 1e-6)
    assert torch.equal(fused, split)
    with pytest.raises(TypeError, match="kv_weight"):
        rope_qkv(q, kv, cos, sin, fused, slots, positions, 1e-6, kv_weight=weight.float())


@pytest.mark.cpu
def test_rope_over_the_whole_head():
    """Tables of D / 2 columns (every pair of the head RoPE'd, no unrotated columns) are accepted
    and give the references' results."""
    assert 2 * _problem(1, 1, ROPE_DIM, 16, 1, "cpu")[6].shape[1] == ROPE_DIM
    _check_attention(_problem(2, 4, ROPE_DIM, 80, 2, "cpu", positions=torch.tensor([79, 5])))
    _check_rope(2, 4, ROPE_DIM, 16, "cpu")


@pytest.mark.cpu
def test_zero_heads_launch_nothing():
    """No query head: an empty ``[T, 0, D]`` output (also into ``out=``), no launch."""
    q, kv_cache, slots, positions, sink, scale, cos, sin = _problem(3, 0, 128, 16, 2, "cpu")
    assert mqa_attention(q, kv_cache, slots, positions, sink, scale, cos, sin).shape == (3, 0, 128)
    out = torch.empty(3, 0, 128, dtype=torch.bfloat16)
    assert mqa_attention(q, kv_cache, slots, positions, sink, scale, cos, sin, out=out) is out


@pytest.mark.cpu
def test_zero_tokens_and_bad_input():
    q, kv_cache, slots, positions, sink, scale, cos, sin = _problem(0, 4, 128, 16, 2, "cpu")
    assert mqa_attention(q, kv_cache, slots, positions, sink, scale, cos, sin).shape == (0, 4, 128)
    cache_before = kv_cache.clone()
    roped = rope_qkv(q.reshape(0, 4 * 128), torch.empty(0, 128, dtype=torch.bfloat16), cos, sin, kv_cache, slots,
                     positions, 1e-6)
    assert roped.shape == (0, 4, 128) and torch.equal(kv_cache, cache_before)
    q, kv_cache, slots, positions, sink, scale, cos, sin = _problem(2, 4, 128, 16, 2, "cpu")
    with pytest.raises(TypeError, match="q must be bfloat16"):
        mqa_attention(q.float(), kv_cache, slots, positions, sink, scale, cos, sin)
    with pytest.raises(TypeError, match="kv_cache must be bfloat16"):
        mqa_attention(q, kv_cache.float(), slots, positions, sink, scale, cos, sin)
    with pytest.raises(TypeError, match="slots"):
        mqa_attention(q, kv_cache, slots.float(), positions, sink, scale, cos, sin)
    with pytest.raises(TypeError, match="sink"):
        mqa_attention(q, kv_cache, slots, positions, sink[:2], scale, cos, sin)
    with pytest.raises(TypeError, match="cos_table"):
        mqa_attention(q, kv_cache, slots, positions, sink, scale, cos.double(), sin)
    with pytest.raises(ValueError, match="even"):
        mqa_attention(q[..., :127], kv_cache[..., :127].contiguous(), slots, positions, sink, scale, cos, sin)
    for bad_scale in (float("nan"), float("inf"), "0.04", True):  # NaN would make every output NaN
        with pytest.raises(ValueError, match="scale must be a finite number"):
            mqa_attention(q, kv_cache, slots, positions, sink, bad_scale, cos, sin)
    with pytest.raises(TypeError, match="q must be bfloat16"):
        rope_qkv(q.float().reshape(2, -1), kv_cache[0, :2], cos, sin, kv_cache, slots, positions, 1e-6)
    # index and sink views with a stride: the kernels read element t at base + t
    strided = lambda t: torch.stack([t, t], dim=1)[:, 0]  # noqa: E731
    kv = kv_cache[0, :2].clone()
    for name, args in (("slots", (strided(slots), positions, sink)), ("positions", (slots, strided(positions), sink)),
                       ("sink", (slots, positions, strided(sink)))):
        with pytest.raises(ValueError, match=f"{name} must be contiguous"):
            mqa_attention(q, kv_cache, *args, scale, cos, sin)
        if name != "sink":
            with pytest.raises(ValueError, match=f"{name} must be contiguous"):
                rope_qkv(q.reshape(2, -1), kv, cos, sin, kv_cache, *args[:2], 1e-6)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        rope_qkv(q.reshape(2, -1), kv, cos, sin, kv_cache, slots, positions, -1.0)
    # no query head: the launch that writes the kv cache would not run
    with pytest.raises(ValueError, match="need columns"):
        rope_qkv(q.reshape(2, -1)[:, :0], kv, cos, sin, kv_cache, slots, positions, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("length,tile", [(256, None), (64, (16, 64)), (1024, (64, 64))],
                         ids=["split-merge", "one-split", "wide"])
def test_out_of_range_indices_write_nothing_and_give_nan_gpu(length, tile):
    _check_out_of_range_indices("cuda", length, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 4, 64, 256, 300])
@pytest.mark.parametrize("heads", [64, 16])
def test_attention_matches_reference_gpu(tokens, heads):
    _check_attention(_problem(tokens, heads, 512, 1024, max(tokens, 1), "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [64, 16])
def test_prefill_attention_gpu(heads):
    """A causal prefill of 512 tokens of one slot: one key split per token (64 heads: the 64 x 64
    tile's one-split epilogue)."""
    tokens = 512
    assert key_splits(tokens, heads, tokens, device=torch.device("cuda")) == 1
    _check_attention(_problem(tokens, heads, 512, tokens, 1, "cuda", positions=torch.arange(tokens, device="cuda")))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 64, 2048])
def test_rope_qkv_matches_reference_gpu(tokens):
    _check_rope(tokens, 64, 512, 4096, "cuda")
    _check_rope(tokens, 16, 512, 4096, "cuda", kv_norm=True)

