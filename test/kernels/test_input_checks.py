"""Bad inputs and output buffers the kernels refuse with a clear ``TypeError`` / ``ValueError``
instead of computing something silently wrong (or failing inside Triton): outputs that share
memory with themselves or with an input, indices tables too short for the cache, tensors on
another device, malformed pairs and launch parameters. All raised on the host, before any launch.
"""

from __future__ import annotations

import pytest
import torch

from fp8chain_kernel import act, attention, einsum, gemm, mhc, norm, quant
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat, QuantizedActivation, check_distinct_elements, check_pair
from fp8chain_kernel.gemv import GemvConfig

pytestmark = pytest.mark.cpu

G32 = ActFormat.SM90_G32_FP32_MN


def bf16(*shape):
    return torch.randn(*shape).bfloat16()


def expanded_rows(rows, cols):
    """A ``[rows, cols]`` view whose rows all share one row of memory."""
    return bf16(1, cols).expand(rows, cols)


# ------------------------------------------------------------------------------------ formats


def test_distinct_elements_accepts_real_layouts_and_refuses_shared_memory():
    check_distinct_elements(bf16(3, 8), "t")
    check_distinct_elements(bf16(3, 16)[:, :8], "t")  # padded rows
    check_distinct_elements(bf16(8, 3).t(), "t")  # column-major
    check_distinct_elements(bf16(1, 8).expand(1, 8), "t")  # one row: nothing shared
    for shared in (expanded_rows(3, 8), bf16(16).as_strided((3, 8), (4, 1)), bf16(3, 4, 8)[:, :1].expand(3, 4, 8)):
        with pytest.raises(ValueError, match="sharing memory"):
            check_distinct_elements(shared, "t")


def test_pair_holds_an_act_format():
    data, scale = quant.quantize(bf16(2, 64), G32)
    assert QuantizedActivation(data, scale, G32.value).fmt is G32  # a format's name is read as the format
    with pytest.raises(ValueError, match="not a valid ActFormat"):
        QuantizedActivation(data, scale, "sm90_g64")
    with pytest.raises(TypeError, match="needs its format"):
        QuantizedActivation._make((data, scale))


def test_pair_with_non_tensor_fields_is_a_type_error():
    with pytest.raises(TypeError, match="must be tensors"):
        check_pair(QuantizedActivation(None, None, G32))
    with pytest.raises(TypeError, match="must be tensors"):
        quant.quantize(bf16(2, 64), G32, out=QuantizedActivation(None, None, G32))


def pair_over(t, rows, cols, fmt=G32):
    """A ``[rows, cols]`` pair of ``fmt`` whose data bytes lie in ``t``'s memory (fresh scales)."""
    data = t.view(torch.uint8).flatten()[:rows * cols].view(rows, cols).view(torch.float8_e4m3fn)
    return QuantizedActivation(data, quant.quantize(bf16(rows, cols), fmt).scale, fmt)


def test_quantize_refuses_a_pair_whose_scales_overlap_its_data_or_the_input():
    pair = quant.quantize(bf16(3, 64), G32)
    scale_in_data = pair.data.view(torch.float32).flatten().as_strided(pair.scale.shape, pair.scale.stride())
    with pytest.raises(ValueError, match="out.data overlaps out.scale"):
        quant.quantize(bf16(3, 64), G32, out=QuantizedActivation(pair.data, scale_in_data, G32))
    x = bf16(3, 64)
    with pytest.raises(ValueError, match="out.data overlaps x"):
        quant.quantize(x, G32, out=pair_over(x, 3, 64))


# --------------------------------------------------------------------------- norm / act / einsum


def test_rms_norm_refuses_outputs_sharing_memory():
    x, w = bf16(3, 64), bf16(64)
    with pytest.raises(ValueError, match="out_bf16 has elements sharing memory"):
        norm.rms_norm(x, w, 1e-6, out_bf16=expanded_rows(3, 64))
    with pytest.raises(ValueError, match="residual has elements sharing memory"):
        norm.rms_norm(x, w, 1e-6, residual=expanded_rows(3, 64))
    residual = bf16(3, 64)
    with pytest.raises(ValueError, match="out_bf16 overlaps residual"):
        norm.rms_norm(x, w, 1e-6, residual=residual, out_bf16=residual)
    with pytest.raises(ValueError, match="residual overlaps x"):
        norm.rms_norm(x, w, 1e-6, residual=x)
    with pytest.raises(ValueError, match="out.data overlaps x"):
        norm.rms_norm(x, w, 1e-6, out=pair_over(x, 3, 64))
    y = bf16(3, 64)
    with pytest.raises(ValueError, match="out_bf16 overlaps out.data"):
        norm.rms_norm(x, w, 1e-6, out=pair_over(y, 3, 64), out_bf16=y)
    storage = bf16(3 * 64)
    with pytest.raises(ValueError, match="out_bf16 overlaps weight"):
        norm.rms_norm(x, storage[64:128], 1e-6, out_bf16=storage.view(3, 64))


def test_numpy_scalars_are_taken_as_the_numbers_they_are():
    """An eps or a swiglu limit read with numpy (np.float32, np.float64) is a number like any other."""
    import numpy as np

    x, w = bf16(3, 128), bf16(128)
    for eps in (np.float32(1e-6), np.float64(1e-6)):
        assert torch.equal(norm.rms_norm(x, w, eps), norm.rms_norm(x, w, 1e-6))
    gate_up = bf16(3, 256) * 8
    assert torch.equal(act.silu_mul(gate_up, limit=np.float32(7.0)), act.silu_mul(gate_up, limit=7.0))
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        norm.rms_norm(x, w, np.bool_(True))


def test_rms_norm_refuses_bool_eps_and_rows_wider_than_a_tile():
    with pytest.raises(ValueError, match="eps"):
        norm.rms_norm(bf16(2, 64), bf16(64), True)
    cols = norm.MAX_TILE_ELEMS + 64
    with pytest.raises(ValueError, match="wider than one program's tile"):
        norm.rms_norm(torch.zeros(1, cols, dtype=torch.bfloat16), torch.ones(cols, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="BLOCK_M"):
        norm.rms_norm(bf16(2, 128), bf16(128), 1e-6, config={"BLOCK_M": 16384, "BLOCK_H": 128, "num_warps": 4})


def test_silu_mul_refuses_shared_output_rows_and_oversized_tiles():
    gate_up = bf16(3, 256)
    with pytest.raises(ValueError, match="out_bf16 has elements sharing memory"):
        act.silu_mul(gate_up, out_bf16=expanded_rows(3, 128))
    with pytest.raises(ValueError, match="BLOCK_M"):
        act.silu_mul(gate_up, config={"BLOCK_M": 16384, "BLOCK_N": 128, "num_warps": 4})
    with pytest.raises(ValueError, match="out_bf16 overlaps gate_up"):
        act.silu_mul(gate_up, out_bf16=gate_up[:, :128])  # in place over the gate half
    with pytest.raises(ValueError, match="out.data overlaps gate_up"):
        act.silu_mul(gate_up, out=pair_over(gate_up, 3, 128), return_bf16=False)


def test_wo_a_einsum_refuses_an_output_over_its_input():
    storage = bf16(3, 2 * 64 + 2 * 32)
    o = storage[:, :128].view(3, 2, 64)  # a strided view of o is fine; writing over it is not
    wo_a = bf16(2, 32, 64)
    with pytest.raises(ValueError, match="out_bf16 overlaps o"):
        einsum.wo_a_einsum(o, wo_a, out_bf16=storage[:, 128:])
    with pytest.raises(ValueError, match="out_bf16 has elements sharing memory"):
        einsum.wo_a_einsum(o, wo_a, out_bf16=expanded_rows(3, 64))


# ------------------------------------------------------------------------------------------ mHC


def mhc_inputs(rows=3, cols=64):
    residual = bf16(rows, 4, cols)
    fn, scale, base = torch.randn(24, 4 * cols) * 0.02, torch.rand(3), torch.randn(24) * 0.1
    pre, post, comb = ref.mhc_stats(residual, fn, scale, base)
    return residual, fn, scale, base, pre, post, comb


def test_mhc_post_refuses_an_output_over_the_mixes_or_sharing_memory():
    residual, _, _, _, _, post, comb = mhc_inputs()
    y = bf16(3, 64)
    storage = torch.zeros(3 * 4 * 64, dtype=torch.bfloat16)
    out = storage.view(3, 4, 64)
    post_in_out = storage.view(torch.float32)[:12].view(3, 4)
    post_in_out.copy_(post)
    with pytest.raises(ValueError, match="out overlaps post"):
        mhc.mhc_post(y, residual, post_in_out, comb, out=out)
    with pytest.raises(ValueError, match="out has elements sharing memory"):
        mhc.mhc_post(y, residual, post, comb, out=bf16(1, 4, 64).expand(3, 4, 64))
    in_place = residual.clone()
    assert mhc.mhc_post(y, in_place, post, comb, out=in_place).data_ptr() == in_place.data_ptr()
    assert torch.equal(in_place, mhc.mhc_post(y, residual, post, comb))  # in place stays fine


def test_mhc_mega_boundary_refuses_a_residual_output_sharing_memory():
    residual, _, _, _, pre, post, comb = mhc_inputs()
    with pytest.raises(ValueError, match="out_residual has elements sharing memory"):
        mhc.mhc_mega_boundary(bf16(3, 64), residual, pre, post, comb, bf16(64), 1e-6,
                              out_residual=bf16(3, 1, 64).expand(3, 4, 64))


def test_mhc_boundary_refuses_no_output_and_outputs_over_each_other():
    residual, _, _, _, pre, post, comb = mhc_inputs()
    with pytest.raises(ValueError, match="return_bf16=False needs an out_format"):
        mhc.mhc_mega_boundary(bf16(3, 64), residual, pre, post, comb, bf16(64), 1e-6, return_bf16=False)
    x = bf16(3, 64)
    with pytest.raises(ValueError, match="out_bf16 overlaps out.data"):
        mhc.mhc_mega_boundary(bf16(3, 64), residual, pre, post, comb, bf16(64), 1e-6, out=pair_over(x, 3, 64),
                              out_bf16=x)
    with pytest.raises(ValueError, match="out_bf16 overlaps out.data"):
        mhc.mhc_combine_norm(residual, pre, bf16(64), 1e-6, out=pair_over(x, 3, 64), out_bf16=x)


def test_mhc_stats_refuses_malformed_or_overlapping_outputs():
    residual, fn, scale, base, pre, post, comb = mhc_inputs()
    with pytest.raises(TypeError, match="out must be a tuple"):
        mhc.mhc_stats(residual, fn, scale, base, out=(pre, post))
    with pytest.raises(TypeError, match="out must be a tuple"):
        mhc.mhc_stats(residual, fn, scale, base, out=(None, post, comb))
    storage = torch.zeros(3 * 4 + 2)
    with pytest.raises(ValueError, match="out pre overlaps out post"):
        mhc.mhc_stats(residual, fn, scale, base, out=(storage[:12].view(3, 4), storage[2:14].view(3, 4), comb))
    with pytest.raises(ValueError, match="out pre overlaps fn"):
        mhc.mhc_stats(residual, fn, scale, base, out=(fn.view(-1)[:12].view(3, 4), post, comb))


def test_mhc_refuses_tensors_too_spread_for_32_bit_offsets():
    """The kernels address a row's streams and mixes (and fn whole) in int32: a tensor spread past
    2**31 elements there would wrap, and the kernel would write before its buffer (an output's
    streams) or read elsewhere. Checked for inputs and outputs alike (meta tensors: no memory)."""
    far = (2**31) // 3 + 64
    meta = dict(device="meta")
    y = torch.empty(1, 128, dtype=torch.bfloat16, **meta)
    residual = torch.empty(1, 4, 128, dtype=torch.bfloat16, **meta)
    post, comb = torch.empty(1, 4, **meta), torch.empty(1, 4, 4, **meta)
    spread = torch.empty_strided((1, 4, 128), (128, far, 1), dtype=torch.bfloat16, **meta)
    with pytest.raises(ValueError, match=r"residual's elements lie too far apart"):
        mhc.mhc_post(y, spread, post, comb)
    with pytest.raises(ValueError, match=r"out's elements lie too far apart"):
        mhc.mhc_post(y, residual, post, comb, out=spread)
    with pytest.raises(ValueError, match=r"post's elements lie too far apart"):
        mhc.mhc_post(y, residual, torch.empty_strided((1, 4), (4, far), **meta), comb)
    with pytest.raises(ValueError, match=r"comb's elements lie too far apart"):
        mhc.mhc_post(y, residual, post, torch.empty_strided((1, 4, 4), (16, far, 1), **meta))
    fn = torch.empty_strided((24, 512), (2**31 // 23 + 64, 1), **meta)
    with pytest.raises(ValueError, match=r"fn's elements lie too far apart"):
        mhc.mhc_stats(residual, fn, torch.empty(3, **meta), torch.empty(24, **meta))


def test_mhc_refuses_inputs_not_unit_stride_along_h():
    """residual, y, out_residual and norm_weight are addressed as unit-stride rows: a view that
    skips columns would be read (or written) as if it did not."""
    residual, fn, scale, base, pre, post, comb = mhc_inputs()
    w, y = bf16(64), bf16(3, 64)
    skipping = bf16(3, 4, 128)[:, :, ::2]
    with pytest.raises(ValueError, match="residual must have unit stride along H"):
        mhc.mhc_post(y, skipping, post, comb)
    with pytest.raises(ValueError, match="residual must have unit stride along H"):
        mhc.mhc_stats(skipping, fn, scale, base)
    with pytest.raises(ValueError, match="y must have unit stride along H"):
        mhc.mhc_mega_boundary(bf16(3, 128)[:, ::2], residual, pre, post, comb, w, 1e-6)
    with pytest.raises(ValueError, match="out_residual must have unit stride along H"):
        mhc.mhc_mega_boundary(y, residual, pre, post, comb, w, 1e-6, out_residual=bf16(3, 4, 128)[:, :, ::2])
    with pytest.raises(ValueError, match="norm_weight must be contiguous"):
        mhc.mhc_combine_norm(residual, pre, bf16(128)[::2], 1e-6)
    with pytest.raises(ValueError, match="fn must have unit stride along 4H"):
        mhc.mhc_stats(residual, torch.randn(4 * 64, 24).t(), scale, base)


def test_mhc_int32_offsets_bound_is_exact():
    """A row's streams may span 2**31 - 1 elements (the largest int32 offset), not 2**31; the rows
    themselves may lie further apart (the kernels step to a row in int64), so a long prefill whose
    residual holds more than 2**31 elements is fine (meta tensors: no memory)."""
    meta = dict(dtype=torch.bfloat16, device="meta")
    y, post, comb = torch.empty(1, 129, **meta), torch.empty(1, 4, device="meta"), torch.empty(1, 4, 4, device="meta")
    at_limit = torch.empty_strided((1, 4, 129), (1, (2**31 - 128) // 3, 1), **meta)  # 3 s + 128 = 2**31
    with pytest.raises(ValueError, match=r"residual's elements lie too far apart"):
        mhc.mhc_post(y, at_limit, post, comb)
    mhc._check_int32_offsets(torch.empty_strided((1, 4, 128), (1, (2**31 - 128) // 3, 1), **meta), "residual")
    mhc._check_int32_offsets(torch.empty((110_000, 4, 5120), **meta), "residual")  # 2.25e9 elements


def test_mhc_outputs_must_not_overlap_any_input():
    """Each output is checked against every input the launch reads: y, residual, the mixes and the
    norm weight (a program writes its slice while others still read)."""
    residual, fn, scale, base, pre, post, comb = mhc_inputs()
    y, w = bf16(3, 64), bf16(64)
    storage = torch.zeros(3, 64, dtype=torch.bfloat16)
    pre_in_out = storage.view(torch.float32).view(-1)[:12].view(3, 4)
    pre_in_out.copy_(pre)
    with pytest.raises(ValueError, match="out_bf16 overlaps pre"):
        mhc.mhc_mega_boundary(y, residual, pre_in_out, post, comb, w, 1e-6, out_bf16=storage)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_bf16 overlaps norm_weight"):
        mhc.mhc_mega_boundary(y, residual, pre, post, comb, x[1], 1e-6, out_bf16=x)
    with pytest.raises(ValueError, match="out_bf16 overlaps residual"):
        mhc.mhc_combine_norm(residual, pre, w, 1e-6, out_bf16=residual[:, 2])
    out = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out overlaps y"):
        mhc.mhc_post(out[:, 1], residual, post, comb, out=out)
    big = bf16(3, 4, 128)
    with pytest.raises(ValueError, match="out overlaps residual"):  # the residual's storage, other strides
        mhc.mhc_post(y, big[:, :, :64], post, comb, out=big.view(3, 8, 64)[:, :4])
    stats_out = (torch.empty(3, 4), torch.empty(3, 4), torch.empty(3, 4, 4))
    flat = residual.view(-1).view(torch.float32)
    with pytest.raises(ValueError, match="out pre overlaps residual"):
        mhc.mhc_stats(residual, fn, scale, base, out=(flat[:12].view(3, 4), *stats_out[1:]))


def test_mhc_stats_refuses_a_non_contiguous_output_and_no_columns():
    residual, fn, scale, base, pre, post, comb = mhc_inputs()
    with pytest.raises(ValueError, match="contiguous"):
        mhc.mhc_stats(residual, fn, scale, base, out=(torch.empty(3, 4), torch.empty(3, 4),
                                                      torch.empty(3, 4, 4).transpose(1, 2)))
    with pytest.raises(ValueError, match="H = 0"):
        mhc.mhc_stats(bf16(3, 4, 0), torch.empty(24, 0), scale, base)


def test_mhc_boundary_refuses_an_out_that_is_not_a_pair():
    residual, _, _, _, pre, post, comb = mhc_inputs()
    for out in (bf16(3, 64), (bf16(3, 64), torch.ones(3, 2))):
        with pytest.raises(TypeError, match="out must be a QuantizedActivation"):
            mhc.mhc_mega_boundary(bf16(3, 64), residual, pre, post, comb, bf16(64), 1e-6, out=out)
        with pytest.raises(TypeError, match="out must be a QuantizedActivation"):
            mhc.mhc_combine_norm(residual, pre, bf16(64), 1e-6, out=out)


# ------------------------------------------------------------------------------------ attention


def attention_inputs(tokens=2, heads=2, dim=128, length=32):
    cos, sin = ref.rope_tables(length, 64, 10000.0, "cpu")
    cache = bf16(tokens, length, dim)
    return cos, sin, cache, torch.arange(tokens), torch.full((tokens,), length - 1)


def test_attention_refuses_rope_tables_shorter_than_the_cache():
    cos, sin, cache, slots, positions = attention_inputs()
    short_cos, short_sin = cos[:16].contiguous(), sin[:16].contiguous()
    with pytest.raises(ValueError, match="a row per position"):
        attention.rope_qkv(bf16(2, 2 * 128), bf16(2, 128), short_cos, short_sin, cache, slots, positions, 1e-6)
    with pytest.raises(ValueError, match="a row per position"):
        attention.mqa_attention(bf16(2, 2, 128), cache, slots, positions, torch.zeros(2), 0.1, short_cos, short_sin)


@pytest.mark.parametrize("slots,positions,match", [
    ((0, -1), (0, 1), r"slots must be in \[0, 2\), got values in \[-1, 0\]"),
    ((0, 1), (-1, 1), r"positions must be in \[0, 32\), got values in \[-1, 1\]"),
    ((0, 2), (0, 1), r"slots must be in \[0, 2\)"),
    ((0, 1), (0, 32), r"positions must be in \[0, 32\)"),
], ids=["negative slot", "negative position", "slot past S", "position past L"])
def test_attention_references_refuse_indices_outside_the_cache(slots, positions, match):
    """The references are the specification of the index contract: a negative index would wrap
    around (torch indexing) and read or write another row."""
    cos, sin, cache, _, _ = attention_inputs()
    slots, positions = torch.tensor(slots), torch.tensor(positions)
    before = cache.clone()
    with pytest.raises(IndexError, match=match):
        ref.rope_qkv(bf16(2, 2 * 128), bf16(2, 128), cos, sin, cache, slots, positions, 1e-6)
    assert torch.equal(cache, before)
    with pytest.raises(IndexError, match=match):
        ref.mqa_attention(bf16(2, 2, 128), cache, slots, positions, torch.zeros(2), 0.1, cos, sin)


def test_attention_reference_refuses_two_tokens_writing_one_cache_row():
    cos, sin, cache, _, _ = attention_inputs()
    same = torch.tensor([1, 1]), torch.tensor([5, 5])
    with pytest.raises(IndexError, match=r"two tokens write one \(slot, position\)"):
        ref.rope_qkv(bf16(2, 2 * 128), bf16(2, 128), cos, sin, cache, *same, 1e-6)
    # reading one row twice is fine
    assert ref.mqa_attention(bf16(2, 2, 128), cache, *same, torch.zeros(2), 0.1, cos, sin).shape == (2, 2, 128)


def test_attention_refuses_tensors_on_another_device():
    cos, sin, cache, slots, positions = attention_inputs()
    elsewhere = torch.empty(2, 128, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="kv is on meta"):
        attention.rope_qkv(bf16(2, 2 * 128), elsewhere, cos, sin, cache, slots, positions, 1e-6)
    with pytest.raises(ValueError, match="positions is on meta"):
        attention.rope_qkv(bf16(2, 2 * 128), bf16(2, 128), cos, sin, cache, slots, positions.to("meta"), 1e-6)
    with pytest.raises(ValueError, match="out is on meta"):
        attention.mqa_attention(bf16(2, 2, 128), cache, slots, positions, torch.zeros(2), 0.1, cos, sin,
                                out=torch.empty(2, 2, 128, dtype=torch.bfloat16, device="meta"))


def test_w8a16_refuses_an_activation_on_another_device():
    weight, scale = ref.random_fp8_weight(64, 128, 32, "cpu", log2_scale=-8)
    elsewhere = torch.empty(2, 128, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="x on meta, weight on cpu"):
        gemm.w8a16_gemm(elsewhere, weight, scale, weight_block=32)


def test_attention_refuses_outputs_over_its_inputs():
    cos, sin, cache, slots, positions = attention_inputs()
    q = bf16(2, 2, 128)
    with pytest.raises(ValueError, match="out overlaps q"):
        attention.mqa_attention(q, cache, slots, positions, torch.zeros(2), 0.1, cos, sin, out=q)
    with pytest.raises(ValueError, match="out overlaps kv_cache"):
        attention.mqa_attention(q, cache, slots, positions, torch.zeros(2), 0.1, cos, sin,
                                out=cache[0, :4].view(2, 2, 128))
    with pytest.raises(ValueError, match="out has elements sharing memory"):
        attention.mqa_attention(q, cache, slots, positions, torch.zeros(2), 0.1, cos, sin,
                                out=bf16(1, 2, 128).expand(2, 2, 128))
    with pytest.raises(TypeError, match="out must be bfloat16"):
        attention.mqa_attention(q, cache, slots, positions, torch.zeros(2), 0.1, cos, sin,
                                out=torch.empty(2, 2, 128))
    q_in_cache = cache[1, :4].reshape(2, 2 * 128)  # the token's query heads stored in the cache
    with pytest.raises(ValueError, match="kv_cache overlaps q"):
        attention.rope_qkv(q_in_cache, bf16(2, 128), cos, sin, cache, slots, positions, 1e-6)


def test_attention_refuses_malformed_rope_tables():
    """Both functions: the tables fp32, 2-D, contiguous (read at row * rd/2 + i), of one shape, at
    most D / 2 columns, on q's device."""
    cos, sin, cache, slots, positions = attention_inputs()
    calls = (lambda c, s: attention.rope_qkv(bf16(2, 2 * 128), bf16(2, 128), c, s, cache, slots, positions, 1e-6),
             lambda c, s: attention.mqa_attention(bf16(2, 2, 128), cache, slots, positions, torch.zeros(2), 0.1, c, s))
    wide_cos, wide_sin = ref.rope_tables(32, 2 * 128 + 4, 10000.0, "cpu")
    for call in calls:
        with pytest.raises(ValueError, match="cos_table is on meta"):
            call(cos.to("meta"), sin)
        with pytest.raises(ValueError, match="sin_table is on meta"):
            call(cos, sin.to("meta"))
        with pytest.raises(ValueError, match="do not fit head dim"):
            call(cos, sin[:, :-2].contiguous())
        with pytest.raises(ValueError, match="do not fit head dim"):
            call(wide_cos, wide_sin)
        with pytest.raises(TypeError, match="sin_table must be a contiguous float32"):
            call(cos, sin.t().contiguous().t())
        with pytest.raises(TypeError, match="cos_table must be a contiguous float32"):
            call(cos.unsqueeze(0), sin)


def test_attention_refuses_malformed_cache_indices_and_sink():
    """The cache bf16 ``[S, L, D]`` of q's D and contiguous; slots / positions one per token; a
    sink view with a stride refused from two heads on (it is read at sink_ptr + head)."""
    cos, sin, cache, slots, positions = attention_inputs()
    q, sink = bf16(2, 2, 128), torch.zeros(2)
    mqa = lambda **kw: attention.mqa_attention(**{**dict(  # noqa: E731
        q=q, kv_cache=cache, slots=slots, positions=positions, sink=sink, scale=0.1, cos_table=cos, sin_table=sin),
        **kw})
    rope = lambda **kw: attention.rope_qkv(**{**dict(  # noqa: E731
        q=bf16(2, 2 * 128), kv=bf16(2, 128), cos_table=cos, sin_table=sin, kv_cache=cache, slots=slots,
        positions=positions, eps=1e-6), **kw})
    for call in (mqa, rope):
        with pytest.raises(TypeError, match=r"kv_cache must be bfloat16 \[S, L, 128\]"):
            call(kv_cache=bf16(2, 32, 64))
        with pytest.raises(ValueError, match="kv_cache must be contiguous"):
            call(kv_cache=cache.transpose(0, 1).contiguous().transpose(0, 1))
        for bad in (torch.arange(3), torch.arange(2).view(2, 1)):
            with pytest.raises(TypeError, match=r"slots must be an int32/int64 \[2\] tensor"):
                call(slots=bad)
            with pytest.raises(TypeError, match=r"positions must be an int32/int64 \[2\] tensor"):
                call(positions=bad)
    with pytest.raises(ValueError, match="sink must be contiguous"):
        mqa(sink=torch.zeros(2, 2)[:, 0])
    with pytest.raises(TypeError, match="sink must be float32"):
        mqa(sink=torch.zeros(2, dtype=torch.bfloat16))


def test_attention_refuses_a_cache_without_positions():
    """L = 0: no token is in range, and an out-of-range token still reads table row 0 (which
    0-row tables lack), so both functions refuse the cache before a launch."""
    cos, sin, _, slots, _ = attention_inputs()
    empty, cos0, sin0, positions = bf16(2, 0, 128), cos[:0], sin[:0], torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="no positions"):
        attention.rope_qkv(bf16(2, 2 * 128), bf16(2, 128), cos0, sin0, empty, slots, positions, 1e-6)
    with pytest.raises(ValueError, match="no positions"):
        attention.mqa_attention(bf16(2, 2, 128), empty, slots, positions, torch.zeros(2), 0.1, cos0, sin0)


def test_attention_without_tokens_takes_a_cache_without_positions():
    """T = 0 reads no table row, so an L = 0 cache is fine there: both functions return the empty
    output the reference does, and the cache stays as it was."""
    empty, cos0, sin0 = bf16(2, 0, 128), torch.zeros(0, 64), torch.zeros(0, 64)
    no_index = torch.zeros(0, dtype=torch.long)
    args = (bf16(0, 2 * 128), bf16(0, 128), cos0, sin0, empty, no_index, no_index, 1e-6)
    got, want = attention.rope_qkv(*args), ref.rope_qkv(*args)
    assert got.shape == want.shape == (0, 2, 128) and got.dtype == want.dtype == torch.bfloat16
    args = (bf16(0, 2, 128), empty, no_index, no_index, torch.zeros(2), 0.1, cos0, sin0)
    got, want = attention.mqa_attention(*args), ref.mqa_attention(*args)
    assert got.shape == want.shape == (0, 2, 128) and got.dtype == want.dtype == torch.bfloat16


def test_rope_qkv_refuses_malformed_q_kv_and_kv_weight():
    """q ``[T, heads * D]`` (whole heads, one row per kv row) and kv ``[T, D]``, unit column strides;
    kv_weight ``[D]``."""
    cos, sin, cache, slots, positions = attention_inputs()
    rope = lambda q, kv, **kw: attention.rope_qkv(q, kv, cos, sin, cache, slots, positions, 1e-6, **kw)  # noqa: E731
    for q in (bf16(2, 2 * 128 + 64), bf16(3, 2 * 128), bf16(2, 4 * 128)[:, ::2]):
        with pytest.raises(TypeError, match=r"q must be bfloat16 \[2, heads\*128\]"):
            rope(q, bf16(2, 128))
    with pytest.raises(TypeError, match="kv must be bfloat16"):
        rope(bf16(2, 2 * 128), bf16(2, 256)[:, ::2])
    for weight in (bf16(64), bf16(1, 128), bf16(256)[::2]):
        with pytest.raises(TypeError, match="kv_weight must be a contiguous bfloat16"):
            rope(bf16(2, 2 * 128), bf16(2, 128), kv_weight=weight)


def test_attention_refuses_a_malformed_out():
    """``out=``: q's shape, bf16, unit last stride (each head's columns read and written at +1)."""
    cos, sin, cache, slots, positions = attention_inputs()
    for out, error, match in ((torch.empty(2, 2, 64, dtype=torch.bfloat16), TypeError, "out must be bfloat16"),
                              (torch.empty(2, 128, 2, dtype=torch.bfloat16), TypeError, "out must be bfloat16"),
                              (torch.empty(2, 2, 256, dtype=torch.bfloat16)[..., ::2], ValueError, "unit last stride")):
        with pytest.raises(error, match=match):
            attention.mqa_attention(bf16(2, 2, 128), cache, slots, positions, torch.zeros(2), 0.1, cos, sin, out=out)


def test_key_splits_refuses_empty_problems():
    for args in ((0, 4, 64), (4, 0, 64), (4, 4, 0)):
        with pytest.raises(ValueError, match="positive ints"):
            attention.key_splits(*args)


# ----------------------------------------------------------------------------------------- GEMM


def test_gemm_refuses_a_float_weight_block():
    w, s = ref.random_fp8_weight(64, 128, 32, "cpu")
    with pytest.raises(ValueError, match="weight_block must be the int 32 or 128"):
        gemm.fp8_gemm(quant.quantize(bf16(2, 128), G32), w, s, weight_block=32.0)


def test_gemm_refuses_malformed_weights_and_mismatched_operands():
    """A weight with unit column stride and K a multiple of its block, on the pair's device; x's K
    the weight's (W8A16); ``fmt=`` beside a pair only if it names the pair's own format."""
    w, s = ref.random_fp8_weight(64, 128, 32, "cpu")
    pair = quant.quantize(bf16(2, 128), G32)
    with pytest.raises(ValueError, match="unit column stride"):
        gemm.fp8_gemm(pair, w.t().contiguous().t(), s, weight_block=32)
    w160, s160 = ref.random_fp8_weight(64, 160, 128, "cpu")
    with pytest.raises(ValueError, match="K=160 must be a multiple of the 128-column group"):
        gemm.w8a16_gemm(bf16(2, 160), w160, s160, weight_block=128)
    with pytest.raises(ValueError, match="x has K=256, weight has K=128"):
        gemm.w8a16_gemm(bf16(2, 256), w, s, weight_block=32)
    on_meta = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")  # noqa: E731
    elsewhere = QuantizedActivation(on_meta(pair.data), on_meta(pair.scale), G32)  # the same layout
    with pytest.raises(ValueError, match="activation on meta, weight on cpu"):
        gemm.fp8_gemm(elsewhere, w, s, weight_block=32)
    with pytest.raises(TypeError, match="fmt=sm90_g128_fp32_mn given with a pair in sm90_g32_fp32_mn"):
        gemm.fp8_gemm(pair, w, s, weight_block=32, fmt=ActFormat.SM90_G128_FP32_MN)
    assert gemm.fp8_gemm(pair, w, s, weight_block=32, fmt=G32).shape == (2, 64)


def test_gemm_refuses_a_config_of_another_type():
    w, s = ref.random_fp8_weight(64, 128, 32, "cpu")
    pair = quant.quantize(bf16(2, 128), G32)
    for config in ({"block_n": 64}, (64, 16, 128)):
        with pytest.raises(TypeError, match="config must be a GemmConfig, got"):
            gemm.fp8_gemm(pair, w, s, weight_block=32, config=config)
    with pytest.raises(TypeError, match=r"config must be a GemmConfig \(the GEMV reads FP8 pairs only\), got GemvConfig"):
        gemm.w8a16_gemm(bf16(2, 128), w, s, weight_block=32, config=GemvConfig(64, 128))


def test_gemm_outputs_refuse_shared_memory_and_overlapping_inputs():
    w, s = ref.random_fp8_weight(64, 128, 32, "cpu")
    pair = quant.quantize(bf16(3, 128), G32)
    with pytest.raises(ValueError, match="out has elements sharing memory"):
        gemm.fp8_gemm(pair, w, s, weight_block=32, out=expanded_rows(3, 64))
    with pytest.raises(TypeError, match="out must be torch.bfloat16"):
        gemm.fp8_gemm(pair, w, s, weight_block=32, out=torch.empty(3, 64))
    over_data = pair.data.view(torch.bfloat16)[:, :64]  # [3, 64] bf16 in the activation's bytes
    with pytest.raises(ValueError, match="out overlaps a.data"):
        gemm.fp8_gemm(pair, w, s, weight_block=32, out=over_data)
    with pytest.raises(ValueError, match="out overlaps weight"):
        gemm.w8a16_gemm(bf16(2, 128), w, s, weight_block=32, out=w.view(torch.bfloat16)[:2])
    gate_up_w, gate_up_s = ref.random_fp8_weight(128, 128, 32, "cpu")
    with pytest.raises(ValueError, match="out_bf16 overlaps a.data"):
        gemm.fp8_gemm_silu_mul(pair, gate_up_w, gate_up_s, weight_block=32, out_bf16=over_data)


def test_wo_a_einsum_refuses_bool_or_odd_warp_counts():
    o, wo_a = bf16(2, 2, 64), bf16(2, 32, 64)
    base = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "num_stages": 1}
    for warps in (True, 3):
        with pytest.raises(ValueError, match="num_warps|positive ints"):
            einsum.wo_a_einsum(o, wo_a, config={**base, "num_warps": warps})


# ------------------------------------------------------------------------------------ swiglu limit


def test_swiglu_limit_outside_fp32_refused():
    """A limit Triton would pass as fp64 (below fp32's smallest normal, or finite past its max)
    is refused on the host, by silu_mul and the gate_up GEMM's epilogue alike; inf and normal
    values are taken."""
    gate_up = bf16(2, 256)
    for limit in (1e-39, 1e-45, 1e39):
        with pytest.raises(ValueError, match="normal fp32"):
            act.silu_mul(gate_up, limit=limit)
        with pytest.raises(ValueError, match="normal fp32"):
            act.check_limit(limit)
    for limit in (2.0 ** -126, 7.0, float("inf")):
        act.check_limit(limit)
    want = ref.silu_mul(gate_up, limit=float("inf"))
    assert torch.equal(act.silu_mul(gate_up, limit=float("inf")).view(torch.int16), want.view(torch.int16))


def test_interpreter_detection_follows_triton(monkeypatch):
    """``interpreting`` reads TRITON_INTERPRET as Triton does: "true" runs the interpreter as "1"
    does, so the kernels' interpreter workarounds (exact e4m3 casts, fp32 dots) must be on."""
    from fp8chain_kernel.fp8_tile import interpreting

    for value, on in (("1", True), ("true", True), ("on", True), ("0", False), ("false", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert interpreting() is on, value


def test_distinct_elements_ignores_the_stride_of_size_one_dims():
    """A one-row view whose row stride is 0 still has one location per element."""
    check_distinct_elements(torch.zeros(8).expand(1, 8), "t")
    check_distinct_elements(torch.zeros(8).as_strided((1, 8), (0, 1)), "t")
