"""wo_a grouped einsum -> bf16, and in the same launch (epilogue) its FP8 pair.

``wo_a_einsum(o, wo_a, *, weight_scale=None, weight_block=32, out_format=None, out=None, out_bf16=None,
return_bf16=True, config=None, tile_group=None)``

* ``o``: bf16 ``[T, G, D]`` with unit stride along ``D`` (any other strides: a strided view of
  the attention output works as it is); ``wo_a``: bf16 ``[G, R, D]``, unit stride along ``D``.
* Or ``wo_a`` e4m3 ``[G, R, D]`` (the checkpoint's FP8 wo_a, ``[G*R, D]`` viewed per group) with
  ``weight_scale`` fp32 ``[G, ceil(R/b), ceil(D/b)]`` (its ``b x b`` block scales viewed the same
  way, ``b = weight_block``: 32 for DSv4.1, or 128): each weight tile is dequantized in registers
  to ``bf16(w * scale)``, exact for DSv4.1's power-of-two scales, the values of a bf16 copy
  dequantized that way (``reference.dequantize_wo_a``), and the launch streams half the weight
  bytes. The products are that copy's; compiled, the fp32 sums may be ordered differently from
  the bf16-weight launch's (the compiler may permute K for an operand converted in registers:
  measured on the H200 at 16-row tiles), so ``y`` can differ from it in the last bit, within the
  same rounding bound. K steps hold whole blocks (``BLOCK_K >= b``). On the H200 this pays only
  for G = 8 at T <= 16 (docs/benchmarks.md, producers): the model keeps wo_a in bf16.
* ``y[t, g*R + r] = bf16(sum_d o[t, g, d] * wo_a[g, r, d])``: ``tl.dot`` on bf16 tiles with fp32
  accumulation, rounded to bf16 once in the epilogue. ``y`` is bf16 ``[T, G*R]`` (the flattened
  ``[T, G, R]`` that ``wo_b`` reads).
* ``out_format``: the epilogue quantizes the bf16-rounded accumulator tile (``quantize_tile`` on
  the tile's columns of the flattened ``[T, G*R]`` matrix) and stores data + scales, so the pair
  equals ``reference.quantize(y, out_format)`` bit for bit. Needs ``R % group_size == 0`` (a
  quantization group never straddles two einsum groups).
* ``out`` / ``out_bf16`` / ``return_bf16``: as ``norm.rms_norm``; neither output may share memory with
  ``o`` or ``wo_a``.
* ``config``: a launch config (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``,
  ``num_stages``, optionally ``SPLIT``) instead of the table's (sweeps); with ``out_format`` or
  ``tile_group``, ``BLOCK_N`` must be a multiple of the group size that divides ``R``.
* ``tile_group``: the scale group (32 or 128 columns) the tiles hold whole, ``out_format``'s by
  default. The tiles set the order of the fp32 sums: a bf16-only call given the group of the
  pair another call writes gets that call's bf16 bits (the model with the chain off).

Grid: one program per ``[BLOCK_M, BLOCK_N]`` output tile of one group and K slice. Decode (small
``T``) is weight streaming, so tiles are short in M and narrow in N (down to one 32-column scale
group) to give enough programs to read ``wo_a`` near HBM bandwidth; where that still leaves SMs
idle (G = 2) ``D`` is split into ``SPLIT`` slices: each stores its fp32 partial tile, and the slice
that arrives last sums them in slice order (deterministic) and runs the epilogue, which needs the
finished sum (``launch.publish_partial`` / ``gather_partials``). Large ``T`` uses 128x128 tiles. For
the packed UE8M0 format with tiles narrower than one 128-column scale word, the epilogue stores
exponent bytes into the int32 words (bytes past the last group are written as zero).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import FP8_DTYPE, ActFormat, QuantizedActivation, cdiv, check_no_overlap, is_int
from .fp8_tile import dequantize_tile, dot_bf16, round_bf16, store_pair_tile
from .launch import (H200_SMS, await_producer, gather_partials, pdl_options, publish_partial, rearm, sm_count,
                     split_workspace, SWEPT_RELEASE, triton_release)
from .norm import MAX_TILE_ELEMS, check_tensor, launch_args, produced, producer_result, resolve_outputs

__all__ = ["wo_a_einsum"]


@triton.jit
def _wo_a_epilogue(acc, y_ptr, data_ptr, scale_ptr, offs_m, offs_n, m_ok, n_ok, g, pid_n, M, G, R,
                   stride_ym, stride_dm, stride_sm, stride_sg,
                   STORE_BF16: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr, POW2: tl.constexpr,
                   PACKED: tl.constexpr, EXACT_CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Round the finished fp32 tile to bf16 once; store it and / or its FP8 pair."""
    yb = round_bf16(acc, EXACT_CAST)
    rows = offs_m.to(tl.int64)[:, None]
    cols = g * R + offs_n
    mask = m_ok[:, None] & n_ok[None, :]
    if STORE_BF16:
        tl.store(y_ptr + rows * stride_ym + cols[None, :], yb, mask=mask)
    if QUANT:
        store_pair_tile(data_ptr + rows * stride_dm + cols[None, :], scale_ptr, yb.to(tl.float32), mask,
                        offs_m, (g * R + pid_n * BLOCK_N) // GROUP, M, tl.cdiv(G * R, GROUP), stride_sm,
                        stride_sg, BLOCK_M, BLOCK_N, GROUP, POW2, PACKED, EXACT_CAST)


@triton.jit
def _wo_a_kernel(o_ptr, w_ptr, ws_ptr, y_ptr, data_ptr, scale_ptr, part_ptr, count_ptr, M, G, R, D,
                 stride_om, stride_og, stride_od, stride_wg, stride_wr, stride_wd, stride_wsg, stride_wsr, stride_wsk,
                 stride_ym, stride_dm, stride_sm, stride_sg,
                 W_FP8: tl.constexpr, STORE_BF16: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                 POW2: tl.constexpr, PACKED: tl.constexpr, EXACT_CAST: tl.constexpr,
                 WEIGHT_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SPLIT: tl.constexpr,
                 K_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    # Axis 0 walks the tiles of one group (M fastest), axis 1 the groups: a group's o rows and
    # weights stay in L2 while its tiles run. Axis 2 is the K slice (K_TILES tiles of BLOCK_K each).
    await_producer(PDL)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    g = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * (K_TILES * BLOCK_K) + tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < R
    a_ptrs = (o_ptr + g.to(tl.int64) * stride_og + offs_m.to(tl.int64)[:, None] * stride_om
              + offs_k[None, :] * stride_od)
    b_ptrs = (w_ptr + g.to(tl.int64) * stride_wg + offs_n.to(tl.int64)[:, None] * stride_wr
              + offs_k[None, :] * stride_wd)
    if W_FP8:
        # the scales of the K step's WEIGHT_BLOCK-column groups, rows of WEIGHT_BLOCK
        SUB: tl.constexpr = BLOCK_K // WEIGHT_BLOCK
        offs_sub = pid_k * (K_TILES * SUB) + tl.arange(0, SUB)
        ws_ptrs = (ws_ptr + g.to(tl.int64) * stride_wsg
                   + (offs_n // WEIGHT_BLOCK).to(tl.int64)[:, None] * stride_wsr + offs_sub[None, :] * stride_wsk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K_TILES (tiles per K slice) is a compile-time constant (D is fixed per model): the loop
    # bound must not be a runtime scalar on the Triton CPU interpreter under numpy 2.x.
    for kt in range(K_TILES):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            if EVEN_N:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (kt * BLOCK_K + offs_k) < D
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if W_FP8:
            # masked-off weights load as 0, their scales (rows past R, groups past D) as 0 too
            sub_ok = (offs_sub + kt * SUB) < tl.cdiv(D, WEIGHT_BLOCK)
            w_s = tl.load(ws_ptrs, mask=n_ok[:, None] & sub_ok[None, :], other=0.0)
            b = dequantize_tile(b, w_s, BLOCK_N, SUB, WEIGHT_BLOCK, EXACT_CAST)
            ws_ptrs += SUB * stride_wsk
        acc = dot_bf16(a, tl.trans(b), acc, EXACT_CAST)
        a_ptrs += BLOCK_K * stride_od
        b_ptrs += BLOCK_K * stride_wd
    if SPLIT == 1:
        _wo_a_epilogue(acc, y_ptr, data_ptr, scale_ptr, offs_m, offs_n, m_ok, n_ok, g, pid_n, M, G, R,
                       stride_ym, stride_dm, stride_sm, stride_sg, STORE_BF16, QUANT, GROUP, POW2, PACKED,
                       EXACT_CAST, BLOCK_M, BLOCK_N)
    else:
        # The FP8 epilogue needs the finished sum: the K slice that arrives last adds the partials
        # in slice order (reproducible whatever the arrival order) and writes the tile.
        tiles = tl.num_programs(0) * tl.num_programs(1)
        tile = g * tl.num_programs(0) + tl.program_id(0)
        if publish_partial(acc, part_ptr, count_ptr, tile, tiles, pid_k, SPLIT, BLOCK_M, BLOCK_N):
            total = gather_partials(part_ptr, tile, tiles, SPLIT, BLOCK_M, BLOCK_N)
            _wo_a_epilogue(total, y_ptr, data_ptr, scale_ptr, offs_m, offs_n, m_ok, n_ok, g, pid_n, M, G, R,
                           stride_ym, stride_dm, stride_sm, stride_sg, STORE_BF16, QUANT, GROUP, POW2, PACKED,
                           EXACT_CAST, BLOCK_M, BLOCK_N)
            rearm(count_ptr, tile)


# Outputs per tile of an FP8 wo_a past 64 rows (8 warps): 256 x 64 and 128 x 128 compile for sm_90
# without spilling, 256 x 128 spills 208 bytes a thread (test_sm90_compile).
FP8_WEIGHT_TILE_OUTPUTS = 128 * 128


def fp8_weight_tile_rows(triton_version: str = triton.__version__) -> int:
    """The tallest FP8-weight wo_a tile that compiles for sm_90 without spilling: 256 rows under
    Triton <= 3.6; Triton 3.8 spills the 256 x 64 tile (288-328 bytes a thread, 1.5x the time at
    T = 2048 on an H100), so 128 there (docs/benchmarks.md, "Triton 3.8")."""
    return 256 if triton_release(triton_version) <= SWEPT_RELEASE else 128


FP8_WEIGHT_TILE_ROWS = fp8_weight_tile_rows()  # for the Triton this process compiles with


def _launch_config(rows: int, groups: int, r: int, d: int, min_n: int, num_sms: int = H200_SMS,
                   min_k: int = 16, w_fp8: bool = False, fp8_tile_rows: int = FP8_WEIGHT_TILE_ROWS) -> dict:
    """Tile sizes and K split for ``rows`` tokens. Decode (<= 64 rows) streams the weights, so the
    tiles are narrow in N (one 32-column scale group) to spread the weights over many programs, and
    deep cp.async pipelines keep each SM's reads in flight. The decode rows come from the H200 sweep
    (``fp8chain bench producers --sweep-wo-a``, docs/benchmarks.md), FP8 out, weights from HBM:

    * a full grid (G=8: 256 programs of 32 columns), <= 16 rows: 16-row tiles (mma.sync), K steps
      of 128, 5 stages: 18.9 us at T=1 against 20.6 us for 256-wide K steps (compiled for sm_90:
      96 against ~166 registers per thread, 8 KiB of shared memory); 17-64 rows: 64 x 64 tiles
      (wgmma), 4 stages;
    * a narrow grid (G=2: 64 tiles), which leaves SMs idle: D is split (``_narrow_split``) as far
      as the whole grid stays resident (two programs per SM, one of the 64-row tiles): <= 16
      rows, 16 x 32 x 128 tiles, 4 stages, 4 slices (T=1: 8.1 us against 9.0 us unsplit, T=4: 8.3
      against 10.5); 17-64 rows, 64 x 32 x 128 tiles with 6 stages and 2 slices (9.1 against 10.0
      us; 4 slices 12.2 us: the second wave).

    Larger batches use compute tiles (64x128, 128x128). An FP8 wo_a (32x32 blocks) there converts
    each weight tile in registers once per M tile, so its tiles are as tall as the batch needs, up
    to 256 x 64 (128 x 128 for 128-column scale groups) with 8 warps: the most that compiles for
    sm_90 without spilling (256 x 128 spills 208 bytes a thread; ``fp8_tile_rows``, by default
    ``FP8_WEIGHT_TILE_ROWS``, caps the height; past 256 rows such a tile is as wide as 128 x 128
    outputs allow); D is split while the grid leaves
    SMs idle (one program per SM); 4 stages up to 256 rows, 3 above (the sweep on an H100, G = 8:
    50.1 against 54.9 us at T = 256, 386 against 316 at T = 2048). Pipeline depth is capped so the
    stages fit in ~192 KiB of shared memory."""
    split = 1
    if rows <= 64:
        block_n = max(min_n, 32)
        tiles = groups * triton.cdiv(r, block_n)
        if tiles < num_sms:
            cfg = (dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, num_warps=4, num_stages=4) if rows <= 16 else
                   dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=128, num_warps=4, num_stages=6))
            # 6 stages of a 64-row tile leave room for one program per SM, of a 16-row tile for two
            per_sm = 1 if cfg["BLOCK_M"] == 64 else 2
            split = _narrow_split(tiles * triton.cdiv(rows, cfg["BLOCK_M"]), triton.cdiv(d, cfg["BLOCK_K"]),
                                  per_sm * num_sms)
        elif rows <= 16:
            cfg = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, num_warps=4, num_stages=5)
        else:
            cfg = dict(BLOCK_M=64, BLOCK_N=max(block_n, 64), BLOCK_K=128, num_warps=4, num_stages=4)
    elif w_fp8 and min_k <= 64:
        # Past 256 rows a tile capped below 256 rows widens to 128 x 128 outputs: it reads o half as
        # often (Triton 3.8, H100, T = 2048, G = 8: 317 against 400 us at 128 x 64); up to 256 rows
        # 64 columns time faster (T = 256: 55.7 against 59.0 us).
        block_n = max(min_n, 64 if rows <= 256 else FP8_WEIGHT_TILE_OUTPUTS // fp8_tile_rows)
        cfg = dict(BLOCK_M=min(FP8_WEIGHT_TILE_OUTPUTS // block_n, fp8_tile_rows, triton.next_power_of_2(rows)),
                   BLOCK_N=block_n, BLOCK_K=64, num_warps=8, num_stages=4 if rows <= 256 else 3)
        split = _narrow_split(triton.cdiv(rows, cfg["BLOCK_M"]) * groups * triton.cdiv(r, cfg["BLOCK_N"]),
                              triton.cdiv(d, cfg["BLOCK_K"]), num_sms)
    elif rows <= 256:
        cfg = dict(BLOCK_M=64, BLOCK_N=max(min_n, 128), BLOCK_K=64, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=max(min_n, 128), BLOCK_K=64, num_warps=8, num_stages=4)
    # A tile never straddles two einsum groups when quantizing: BLOCK_N divides R.
    while cfg["BLOCK_N"] > min_n and r % cfg["BLOCK_N"]:
        cfg["BLOCK_N"] //= 2
    cfg["BLOCK_K"] = _clamp_block_k(cfg["BLOCK_K"], d, min_k)
    while True:
        stage_bytes = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
        if cfg["num_stages"] * stage_bytes <= 192 * 1024 or cfg["num_stages"] <= 2:
            break
        if cfg["BLOCK_K"] > max(64, min_k):
            cfg["BLOCK_K"] //= 2
        else:
            cfg["num_stages"] -= 1
    cfg["SPLIT"] = split
    return cfg


def _clamp_block_k(block_k: int, d: int, min_k: int) -> int:
    """K step no wider than D needs (a power of two) and at least ``min_k`` (whole scale blocks of
    an FP8 wo_a, else 16: the smallest dot)."""
    return max(min_k, min(block_k, triton.next_power_of_2(d)))


def _narrow_split(tiles: int, k_tiles: int, resident: int) -> int:
    """K slices for a grid of ``tiles`` output tiles: doubled (up to 8) while all programs stay
    resident at once (at most ``resident``) and every slice keeps at least two K tiles."""
    split = 1
    while split < 8 and tiles * split * 2 <= resident and k_tiles >= split * 4:
        split *= 2
    return split


CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")  # and optionally SPLIT (default 1)


def _check_config(config: dict, r: int, min_n: int) -> dict:
    if not isinstance(config, dict) or not set(CONFIG_KEYS) <= set(config) <= set(CONFIG_KEYS) | {"SPLIT"}:
        raise ValueError(f"config must be a dict with keys {CONFIG_KEYS} and optionally SPLIT, got {config!r}")
    if any(not is_int(v) or v < 1 for v in config.values()):
        raise ValueError(f"config values must be positive ints, got {config!r}")
    if config["num_warps"] & (config["num_warps"] - 1) or config["num_warps"] > 16:
        raise ValueError(f"num_warps must be a power of two <= 16, got {config!r}")
    m, n, k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if max(m * k, n * k, m * n) > MAX_TILE_ELEMS:  # Triton's limit on one tensor
        raise ValueError(f"a tile of BLOCK_M*BLOCK_K, BLOCK_N*BLOCK_K or BLOCK_M*BLOCK_N holds at most "
                         f"{MAX_TILE_ELEMS} values, got {config!r}")
    if any(config[k] < 16 or config[k] & (config[k] - 1) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")):
        raise ValueError(f"BLOCK_M/N/K must be powers of two >= 16, got {config!r}")
    if config["BLOCK_N"] % min_n or (min_n > 16 and r % config["BLOCK_N"]):
        raise ValueError(f"BLOCK_N={config['BLOCK_N']} must be a multiple of {min_n} that divides R={r} "
                         "(a scale group may not straddle two tiles or two einsum groups)")
    return {"SPLIT": 1, **config}


def _tile_group(fmt: ActFormat | None, tile_group, r: int) -> int:
    """The columns a tile must hold whole (``wo_a_einsum``'s ``tile_group``): 16 for none."""
    if tile_group is None:
        return fmt.group_size if fmt is not None else 16
    if not is_int(tile_group) or tile_group not in (32, 128) or r % tile_group:
        raise ValueError(f"tile_group must be 32 or 128 and divide R={r}, got {tile_group!r}")
    if fmt is not None and tile_group != fmt.group_size:
        raise ValueError(f"tile_group={tile_group} but out_format {fmt.value} has {fmt.group_size}-column groups")
    return tile_group


WEIGHT_BLOCKS = (32, 128)  # an FP8 wo_a's square scale blocks (DSv4.1 checkpoints: 32)


def _check_weight(wo_a: torch.Tensor, weight_scale: torch.Tensor | None, weight_block: int) -> bool:
    """A bf16 ``wo_a`` without scales, or an e4m3 one with its fp32 ``[G, ceil(R/b), ceil(D/b)]``
    block scales (``b = weight_block``); returns whether the weights are FP8."""
    if not isinstance(wo_a, torch.Tensor) or wo_a.dtype not in (torch.bfloat16, FP8_DTYPE):
        raise TypeError(f"wo_a must be a bfloat16 or {FP8_DTYPE} tensor, got "
                        f"{getattr(wo_a, 'dtype', type(wo_a).__name__)}")
    if wo_a.dim() != 3:
        raise ValueError(f"wo_a must be 3-D [G, R, D], got shape {tuple(wo_a.shape)}")
    if wo_a.dtype == torch.bfloat16:
        if weight_scale is not None:
            raise TypeError("weight_scale was given for a bfloat16 wo_a (it scales an FP8 wo_a)")
        return False
    if weight_scale is None:
        raise TypeError(f"a {FP8_DTYPE} wo_a needs weight_scale (its fp32 block scales)")
    if not is_int(weight_block) or weight_block not in WEIGHT_BLOCKS:
        raise ValueError(f"weight_block must be one of {WEIGHT_BLOCKS}, got {weight_block!r}")
    check_tensor(weight_scale, "weight_scale", torch.float32, 3)
    groups, r, d = wo_a.shape
    want = (groups, cdiv(r, weight_block), cdiv(d, weight_block))
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"wo_a {tuple(wo_a.shape)} with {weight_block}x{weight_block} blocks needs weight_scale "
                         f"{want}, got {tuple(weight_scale.shape)}")
    if weight_scale.device != wo_a.device:
        raise ValueError(f"weight_scale is on {weight_scale.device}, wo_a on {wo_a.device}")
    return True


def wo_a_einsum(o: torch.Tensor, wo_a: torch.Tensor, *, weight_scale: torch.Tensor | None = None,
                weight_block: int = 32, out_format: ActFormat | str | None = None,
                out: QuantizedActivation | None = None, out_bf16: torch.Tensor | None = None,
                return_bf16: bool = True, config: dict | None = None, tile_group: int | None = None):
    """Grouped einsum ``o [T, G, D] x wo_a [G, R, D] -> [T, G*R]`` bf16 (+ FP8 pair), ``wo_a``
    bf16 or e4m3 with ``weight_scale``; see the module docstring. ``D = 0`` (with T and G*R not 0)
    is refused with ``ValueError``: no DSv4.1 shape has it (the reference would return zeros).

    ``tile_group``: the scale group (32 or 128 columns) the launch's tiles hold whole; default
    ``out_format``'s group, else none. The tiles set the order of the fp32 sums, so a bf16-only
    call passes the group of the pair the chained call writes to get its bf16 bits exactly (the
    model with the chain switched off); a call with ``out_format`` takes only that group."""
    check_tensor(o, "o", torch.bfloat16, 3)
    w_fp8 = _check_weight(wo_a, weight_scale, weight_block)
    rows, groups, d = o.shape
    if wo_a.shape[0] != groups or wo_a.shape[2] != d:
        raise ValueError(f"wo_a must be [G={groups}, R, D={d}] for o {tuple(o.shape)}, got {tuple(wo_a.shape)}")
    r = wo_a.shape[1]
    if wo_a.device != o.device:
        raise ValueError(f"wo_a is on {wo_a.device}, o on {o.device}")
    if o.numel() and o.stride(2) != 1:
        raise ValueError(f"o must have unit stride along D, got strides {o.stride()}")
    if wo_a.numel() and wo_a.stride(2) != 1:
        raise ValueError(f"wo_a must have unit stride along D, got strides {wo_a.stride()}")
    cols = groups * r
    fmt, pair, y = resolve_outputs(rows, cols, o.device, out_format, out, out_bf16, return_bf16)
    check_no_overlap(produced(pair, y), [("o", o), ("wo_a", wo_a), ("weight_scale", weight_scale)])
    if fmt is not None and r % fmt.group_size:
        raise ValueError(f"{fmt.value} needs R % {fmt.group_size} == 0 (a scale group may not straddle "
                         f"two einsum groups), got R={r}")
    min_n = _tile_group(fmt, tile_group, r)
    if rows == 0 or cols == 0:
        return producer_result(y, pair)
    if d == 0:
        raise ValueError("o and wo_a have D = 0")
    a = launch_args(fmt, pair, y, o)
    # an FP8 wo_a's K steps hold whole scale blocks
    min_k = weight_block if w_fp8 else 16
    if config is not None:
        cfg = _check_config(config, r, min_n)
        if cfg["BLOCK_K"] < min_k:
            raise ValueError(f"an FP8 wo_a needs BLOCK_K >= {min_k} (whole scale blocks), got {config!r}")
        cfg["BLOCK_K"] = _clamp_block_k(cfg["BLOCK_K"], d, min_k)
    else:
        cfg = _launch_config(rows, groups, r, d, min_n, sm_count(o.device, interpreter=H200_SMS), min_k, w_fp8)
    block_n = cfg["BLOCK_N"]
    tiles = triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(r, block_n)
    k_tiles = triton.cdiv(d, cfg["BLOCK_K"])
    split, part, counters = split_workspace("wo_a", min(cfg.pop("SPLIT"), k_tiles), tiles * groups,
                                            cfg["BLOCK_M"] * block_n, o.device)
    slice_tiles = triton.cdiv(k_tiles, split)
    ws = weight_scale if w_fp8 else o
    _wo_a_kernel[(tiles, groups, split)](
        o, wo_a, ws, a["y"], a["data"], a["scale"], o if part is None else part,
        o if counters is None else counters, rows, groups, r, d,
        o.stride(0), o.stride(1), o.stride(2), wo_a.stride(0), wo_a.stride(1), wo_a.stride(2),
        *(ws.stride() if w_fp8 else (0, 0, 0)), a["y_stride"], *a["strides"],
        W_FP8=w_fp8, WEIGHT_BLOCK=weight_block if w_fp8 else 0,
        STORE_BF16=a["STORE_BF16"], QUANT=a["QUANT"], EVEN_K=d % (cfg["BLOCK_K"] * split) == 0, SPLIT=split,
        K_TILES=slice_tiles, EVEN_N=r % block_n == 0, **cfg, **a["consts"], **pdl_options(o.device),
    )
    return producer_result(y, pair)
