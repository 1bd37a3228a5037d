"""The Triton side of gguf_cuda.py: each GGUF type's decoding of a 256-value tile, and the two
kernels written once over them (a dequantization, a GEMV). Imported only when a kernel first runs,
so that triton is imported only where a kernel is used; Triton resolves the helpers a kernel calls
among its module's globals, hence a module of their own.

Values stay [channels, groups, group length] from their decoding to the store or the sum: a
group's scale broadcasts along the last axis, and nothing is reshaped (a reshape may cost a trip
through shared memory on a GPU). The GEMV sums products element-wise and reduces once at the end,
as the int8 GEMV does, rather than across the program at every tile.

What a GEMV issues, compiled for an H100 (scripts/gguf_cuda_sass.py): the main loop's instructions
per weight byte in the shape gguf_cuda launches (16 channels × 8 warps), at 1 and 8 rows, before
and after the unpacking was cut down (a 4-bit code masked in place as 16 × itself, the 1/16 folded
into its group's scale; codes shifted as 32-bit words, not bytes). An H100 issues ~10 a byte at
copy bandwidth: every type is still bound by its instructions on the GEMV.

    | type   | 1 row: before → after | 8 rows: before → after |
    |--------|-----------------------|------------------------|
    | Q4_K   | 20.2 → 16.8           | 35.7 → 31.6            |
    | Q5_K   | 29.1 → 20.8           | 41.1 → 32.8            |
    | Q6_K   | 31.1 → 26.2           | 40.9 → 36.3            |
    | Q4_0   | 31.0 → 26.2           | 46.1 → 40.8            |
    | Q8_0   | 14.9 (unchanged)      | 22.9 (unchanged)       |
    | IQ4_XS | 35.9 (unchanged)      | 52.0 (unchanged)       |

Tried and dropped, as they issued more: a sum per group with its scale applied once (the
sum across a group's 32 values crosses threads at every tile: Q4_K 42.9 a byte), nibbles
unpacked from 32-bit words loaded whole (the reshape to a group's values: 111), and IQ4_NL's
codebook in four 32-bit words (three selects a value: 41.8)."""

import triton
import triton.language as tl


@triton.jit
def half(pointers, mask):
    """The little-endian fp16 at each of `pointers` (bytes), as fp32."""
    low = tl.load(pointers, mask=mask, other=0).to(tl.uint16)
    high = tl.load(pointers + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


TWO_23 = tl.constexpr(0x4B000000)  # 2^23's bits as an fp32: its mantissa holds any integer below 2^23


@triton.jit
def exact_float(q, offset: tl.constexpr):
    """q - offset as fp32, exactly, for an unsigned integer q below 2^23: q set into the mantissa
    of 2^23 (the float 2^23 + q), then 2^23 + offset subtracted. An OR and an add, each issued
    at the full rate, where a conversion (I2F) issues at a fraction of it."""
    return (q.to(tl.uint32) | TWO_23).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def decode_32(row, tile, live, TYPE: tl.constexpr):
    """Q8_0 (d, 32 int8) or Q4_0 (d, 16 bytes of nibbles: value j low, j + 16 high) blocks
    8·tile … 8·tile + 7 of each row; `live` [BLOCK_N, 8] masks rows and blocks past the end."""
    group = tl.arange(0, 8)
    at = tl.arange(0, 32)
    nbytes: tl.constexpr = 34 if TYPE == 0 else 18
    block = row[:, None] + (tile * 8 + group)[None, :] * nbytes  # [BLOCK_N, 8]
    d = half(block, live)
    inside = live[:, :, None] & (at < 32)[None, None, :]
    if TYPE == 0:
        codes = tl.load(block[:, :, None] + 2 + at[None, None, :], mask=inside, other=0)
        q = exact_float(codes ^ 0x80, 128)  # the int8 biased by 128
        scale = d[:, :, None]
    else:
        codes = tl.load(block[:, :, None] + 2 + (at % 16)[None, None, :], mask=inside, other=0)
        high = at >= 16  # kept in place as 16 × the code, the 1/16 folded into the scale (exact)
        bits = (codes.to(tl.uint32) & tl.where(high, 0xF0, 0x0F).to(tl.uint32)[None, None, :]) | TWO_23
        q = bits.to(tl.float32, bitcast=True) - tl.where(high, 8388608.0 + 128, 8388608.0 + 8)[None, None, :]
        scale = d[:, :, None] * tl.where(high, 0.0625, 1.0)[None, None, :]
    return q * scale


@triton.jit
def k_scales(block, live):
    """Q4_K/Q5_K's eight 6-bit scales and minimums, packed in 12 bytes after d and dmin."""
    group = tl.arange(0, 8)
    low = group < 4
    first = tl.load(block[:, None] + 4 + group[None, :], mask=live[:, None], other=0)  # byte g
    second = tl.load(block[:, None] + 8 + group[None, :], mask=live[:, None], other=0)  # byte g + 4
    below = tl.where(low, group, group - 4)
    third = tl.load(block[:, None] + 4 + below[None, :], mask=live[:, None], other=0)  # byte g - 4
    scale = tl.where(low[None, :], first & 63, (second & 15) | ((third >> 6) << 4))
    minimum = tl.where(low[None, :], second & 63, (second >> 4) | ((first >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def decode_k(row, tile, live, TYPE: tl.constexpr):
    """Q4_K (d, dmin, scales, 128 bytes of nibbles) or Q5_K (the same and 32 bytes of fifth
    bits) super-block `tile` of each row: group g is the low (g even) or high nibbles of
    bytes 32·(g // 2) …, and Q5_K's bit g of byte j its value j's fifth bit."""
    nbytes: tl.constexpr = 144 if TYPE == 2 else 176
    codes_at: tl.constexpr = 16 if TYPE == 2 else 48
    block = row + tile * nbytes  # [BLOCK_N]
    d = half(block, live)
    dmin = half(block + 2, live)
    scale, minimum = k_scales(block, live)
    group = tl.arange(0, 8)
    at = tl.arange(0, 32)
    inside = live[:, None, None] & (group < 8)[None, :, None] & (at < 32)[None, None, :]
    offset = ((group // 2) * 32)[:, None] + at[None, :]  # [8, 32]
    codes = tl.load(block[:, None, None] + codes_at + offset[None, :, :], mask=inside, other=0)
    odd = group % 2 == 1  # high nibbles: kept in place, as 16 × the code (no shift per value)
    # Masked as 32-bit words for Q4_K, as bytes for Q5_K: what issues fewest (gguf_cuda_sass.py).
    if TYPE == 2:
        q = codes.to(tl.uint32) & tl.where(odd, 0xF0, 0x0F).to(tl.uint32)[None, :, None]
    else:
        q = codes & tl.where(odd, 0xF0, 0x0F).to(tl.uint8)[None, :, None]
        high = tl.load(block[:, None, None] + 16 + at[None, None, :], mask=inside, other=0)
        fifth = high.to(tl.uint32) << tl.where(odd, 8, 4)[None, :, None] >> group[None, :, None]
        q = q.to(tl.uint32) | (fifth & tl.where(odd, 0x100, 0x10)[None, :, None])
    scaled = (d[:, None] * scale * tl.where(odd, 0.0625, 1.0))[:, :, None]  # exact: a power of 2
    shifted = (dmin[:, None] * minimum)[:, :, None]
    return scaled * exact_float(q, 0) - shifted


@triton.jit
def decode_q6_k(row, tile, live):
    """Q6_K (128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d): value p's
    low nibble is byte 64·(p // 128) + p % 64's (high nibble from p % 128 ≥ 64), its high
    bits byte 128 + 32·(p // 128) + p % 32's pair (p % 128) // 32; scale p // 16."""
    block = row + tile * 210
    d = half(block + 208, live)
    group = tl.arange(0, 16)
    scale = tl.load(block[:, None] + 192 + group[None, :], mask=live[:, None], other=0)
    scale = scale.to(tl.int8, bitcast=True).to(tl.float32)
    p = group[:, None] * 16 + tl.arange(0, 16)[None, :]  # [16, 16]
    inside = live[:, None, None] & (p < 256)[None, :, :]
    # Shifted as 32-bit words: shifts of bytes keep them packed four to a register, and unpacking
    # them costs byte permutations (PRMT) at every step.
    low = tl.load(block[:, None, None] + (64 * (p // 128) + p % 64)[None, :, :], mask=inside, other=0)
    low = (low.to(tl.uint32) >> (((p % 128) // 64) * 4).to(tl.uint32)[None, :, :]) & 15
    high = tl.load(block[:, None, None] + (128 + 32 * (p // 128) + p % 32)[None, :, :], mask=inside, other=0)
    high = ((high.to(tl.uint32) << 4) >> (((p % 128) // 32) * 2).to(tl.uint32)[None, :, :]) & 0x30
    q = exact_float(low | high, 32)
    return (d[:, None] * scale)[:, :, None] * q


# IQ4_NL's codebook (llama.cpp's kvalues_iq4nl: -127, -104, … 89, 113) as int8 bytes packed in two
# 64-bit words, value i byte i % 8 of word i // 8: decoded in registers, with no table in memory.
# (Triton reads a global only as a tl.constexpr object.)
IQ4_LOW = tl.constexpr(-0x91522304052677F)  # bytes 81 98 AD BF CF DD EA F6, lowest first
IQ4_HIGH = tl.constexpr(0x7159453526190D01)  # bytes 01 0D 19 26 35 45 59 71


@triton.jit
def iq4_value(index):
    """IQ4_NL's value number `index` (0…15, int64), as fp32."""
    word = tl.where(index < 8, IQ4_LOW, IQ4_HIGH)
    return exact_float(((word >> ((index % 8) * 8)) & 0xFF) ^ 0x80, 128)  # the int8 biased by 128


@triton.jit
def decode_iq4_xs(row, tile, live):
    """IQ4_XS (d, 16 bits of scales' high pairs, 4 bytes of their low nibbles, 128 bytes of
    indices into IQ4_NL's 16 values): group g's scale is (nibble g of the 4 bytes | pair g << 4) - 32, its
    value j the low (j < 16) or high nibble of byte 16·g + j % 16."""
    block = row + tile * 136
    d = half(block, live)
    group = tl.arange(0, 8)
    pairs = (tl.load(block + 2, mask=live, other=0).to(tl.int32)) | (
        tl.load(block + 3, mask=live, other=0).to(tl.int32) << 8
    )
    nibbles = tl.load(block[:, None] + 4 + (group // 2)[None, :], mask=live[:, None], other=0).to(tl.int32)
    low = (nibbles >> ((group % 2) * 4)[None, :]) & 15
    scale = (low | (((pairs[:, None] >> (2 * group)[None, :]) & 3) << 4)) - 32
    at = tl.arange(0, 32)
    inside = live[:, None, None] & (group < 8)[None, :, None] & (at < 32)[None, None, :]
    offset = (group * 16)[:, None] + (at % 16)[None, :]
    codes = tl.load(block[:, None, None] + 8 + offset[None, :, :], mask=inside, other=0)
    index = (codes >> ((at // 16) * 4).to(tl.uint8)[None, None, :]) & 15
    q = iq4_value(index.to(tl.int64))
    return (d[:, None] * scale.to(tl.float32))[:, :, None] * q


@triton.jit
def decode(w, channels, tile, N, K, row_bytes, TYPE: tl.constexpr):
    """Values tile·256 … tile·256 + 255 of rows `channels` in fp32, as [BLOCK_N, groups, group
    length] (tile_columns' layout); rows past N and values past K read as 0."""
    live = channels < N
    row = w + channels.to(tl.int64) * row_bytes
    if TYPE <= 1:
        blocks_live = live[:, None] & ((tile * 8 + tl.arange(0, 8)) * 32 < K)[None, :]
        values = decode_32(row, tile, blocks_live, TYPE)
    elif TYPE <= 3:
        values = decode_k(row, tile, live, TYPE)
    elif TYPE == 4:
        values = decode_q6_k(row, tile, live)
    else:
        values = decode_iq4_xs(row, tile, live)
    return values


@triton.jit
def tile_columns(tile, TYPE: tl.constexpr):
    """[groups, group length]: the column of each decoded value — 16 groups of 16 for Q6_K (a
    scale each), 8 of 32 for the others."""
    GROUPS: tl.constexpr = 16 if TYPE == 4 else 8
    LENGTH: tl.constexpr = 256 // GROUPS
    return tile * 256 + tl.arange(0, GROUPS)[:, None] * LENGTH + tl.arange(0, LENGTH)[None, :]


@triton.jit
def stored(values, dtype: tl.constexpr):
    """fp32 `values` in the output's dtype, bf16 rounded to nearest even as torch rounds it: by
    hand, because Triton's interpreter truncates (on a GPU the same bits as its own conversion)."""
    if dtype == tl.bfloat16:
        bits = values.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return values.to(dtype)


@triton.jit
def gguf_dequantize(w, out, N, K, row_bytes, TYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    channels = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tile = tl.program_id(1)
    values = decode(w, channels, tile, N, K, row_bytes, TYPE)
    columns = tile_columns(tile, TYPE)
    inside = (channels < N)[:, None, None] & (columns < K)[None, :, :]
    target = out + channels.to(tl.int64)[:, None, None] * K + columns[None, :, :]
    tl.store(target, stored(values, out.dtype.element_ty), mask=inside)


@triton.jit
def gguf_gemv(
    x, w, out, M, N, K, row_bytes, TYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Every row of x against BLOCK_N channels: each tile decoded once for all rows, the products
    summed element-wise and reduced once at the end (no reduction across the program per tile)."""
    channels = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    GROUPS: tl.constexpr = 16 if TYPE == 4 else 8
    acc = tl.zeros((BLOCK_M, BLOCK_N, GROUPS, 256 // GROUPS), dtype=tl.float32)
    for tile in range(0, tl.cdiv(K, 256)):
        values = decode(w, channels, tile, N, K, row_bytes, TYPE)
        columns = tile_columns(tile, TYPE)
        inside = (rows < M)[:, None, None] & (columns < K)[None, :, :]
        xs = tl.load(x + rows[:, None, None] * K + columns[None, :, :], mask=inside, other=0.0).to(tl.float32)
        acc += values[None, :, :, :] * xs[:, None, :, :]
    total = tl.sum(tl.sum(acc, axis=3), axis=2)
    target = out + rows[:, None] * N + channels[None, :]
    tl.store(target, stored(total, out.dtype.element_ty), mask=(rows < M)[:, None] & (channels < N)[None, :])
