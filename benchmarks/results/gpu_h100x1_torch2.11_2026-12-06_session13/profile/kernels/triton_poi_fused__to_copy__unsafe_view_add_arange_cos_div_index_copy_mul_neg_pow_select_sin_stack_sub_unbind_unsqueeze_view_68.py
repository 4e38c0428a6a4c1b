
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'y': 64, 'x': 256}, tile_hint=TileHint.DEFAULT,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*i64', 'in_ptr2': '*i64', 'out_ptr1': '*bf16', 'ynumel': 'i32', 'xnumel': 'i32', 'YBLOCK': 'constexpr', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid2D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused__to_copy__unsafe_view_add_arange_cos_div_index_copy_mul_neg_pow_select_sin_stack_sub_unbind_unsqueeze_view_68', 'mutated_arg_names': ['out_ptr1'], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 9, 'num_store': 1, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'y': 512, 'x': 0}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused__to_copy__unsafe_view_add_arange_cos_div_index_copy_mul_neg_pow_select_sin_stack_sub_unbind_unsqueeze_view_68(in_ptr0, in_ptr1, in_ptr2, out_ptr1, ynumel, xnumel, YBLOCK : tl.constexpr, XBLOCK : tl.constexpr):
    ynumel = 64
    xnumel = 192
    yoffset = tl.program_id(1) * YBLOCK
    yindex = yoffset + tl.arange(0, YBLOCK)[:, None]
    ymask = yindex < ynumel
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[None, :]
    xmask = xindex < xnumel
    x1 = (xindex % 2)
    x5 = xindex // 2
    y0 = yindex
    x2 = ((xindex // 2) % 32)
    x4 = xindex
    tmp59 = tl.load(in_ptr1 + (0))
    tmp60 = tl.broadcast_to(tmp59, [1, 1])
    tmp0 = x1
    tmp1 = tl.full([1, 1], 0, tl.int64)
    tmp2 = tmp0 >= tmp1
    tmp3 = tl.full([1, 1], 1, tl.int64)
    tmp4 = tmp0 < tmp3
    tmp5 = tl.load(in_ptr0 + (2*x5 + 192*y0), tmp4 & xmask & ymask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp6 = tmp5.to(tl.float32)
    tmp7 = tl.load(in_ptr1 + (0))
    tmp8 = tl.broadcast_to(tmp7, [1, 1])
    tmp9 = tl.where(tmp4, tmp8, 0)
    tmp10 = tl.load(in_ptr2 + (tl.broadcast_to(y0, [YBLOCK, XBLOCK])), tmp4 & xmask & ymask, eviction_policy='evict_last', other=0.0)
    tmp11 = tmp9 + tmp10
    tmp12 = tmp11.to(tl.float32)
    tmp13 = tl.broadcast_to(2*x2, [YBLOCK, XBLOCK])
    tmp14 = tmp13.to(tl.float32)
    tmp15 = tl.full([1, 1], 0.015625, tl.float32)
    tmp16 = tmp14 * tmp15
    tmp17 = -tmp16
    tmp18 = tl.full([1, 1], 100000.0, tl.float32)
    tmp19 = libdevice.pow(tmp18, tmp17)
    tmp20 = tmp12 * tmp19
    tmp21 = tl_math.cos(tmp20)
    tmp22 = tmp6 * tmp21
    tmp23 = tl.load(in_ptr0 + (1 + 2*x5 + 192*y0), tmp4 & xmask & ymask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp24 = tmp23.to(tl.float32)
    tmp25 = tl_math.sin(tmp20)
    tmp26 = tmp24 * tmp25
    tmp27 = tmp22 - tmp26
    tmp28 = tl.full(tmp27.shape, 0.0, tmp27.dtype)
    tmp29 = tl.where(tmp4, tmp27, tmp28)
    tmp30 = tmp0 >= tmp3
    tmp31 = tl.full([1, 1], 2, tl.int64)
    tmp32 = tmp0 < tmp31
    tmp33 = tl.load(in_ptr0 + (2*x5 + 192*y0), tmp30 & xmask & ymask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp34 = tmp33.to(tl.float32)
    tmp35 = tl.load(in_ptr1 + (0))
    tmp36 = tl.broadcast_to(tmp35, [1, 1])
    tmp37 = tl.where(tmp30, tmp36, 0)
    tmp38 = tl.load(in_ptr2 + (tl.broadcast_to(y0, [YBLOCK, XBLOCK])), tmp30 & xmask & ymask, eviction_policy='evict_last', other=0.0)
    tmp39 = tmp37 + tmp38
    tmp40 = tmp39.to(tl.float32)
    tmp41 = tl.broadcast_to(2*x2, [YBLOCK, XBLOCK])
    tmp42 = tmp41.to(tl.float32)
    tmp43 = tl.full([1, 1], 0.015625, tl.float32)
    tmp44 = tmp42 * tmp43
    tmp45 = -tmp44
    tmp46 = tl.full([1, 1], 100000.0, tl.float32)
    tmp47 = libdevice.pow(tmp46, tmp45)
    tmp48 = tmp40 * tmp47
    tmp49 = tl_math.sin(tmp48)
    tmp50 = tmp34 * tmp49
    tmp51 = tl.load(in_ptr0 + (1 + 2*x5 + 192*y0), tmp30 & xmask & ymask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp52 = tmp51.to(tl.float32)
    tmp53 = tl_math.cos(tmp48)
    tmp54 = tmp52 * tmp53
    tmp55 = tmp50 + tmp54
    tmp56 = tl.full(tmp55.shape, 0.0, tmp55.dtype)
    tmp57 = tl.where(tmp30, tmp55, tmp56)
    tmp58 = tl.where(tmp4, tmp29, tmp57)
    tmp61 = y0
    tmp62 = tmp60 + tmp61
    tmp63 = tl.full([1, 1], 192, tl.int32)
    tmp64 = tmp62 + tmp63
    tmp65 = tmp62 < 0
    tmp66 = tl.where(tmp65, tmp64, tmp62)
    tl.device_assert(((0 <= tmp66) & (tmp66 < 192)) | ~(ymask), "index out of bounds: 0 <= tmp66 < 192")
    tmp68 = tmp58.to(tl.float32)
    tl.store(out_ptr1 + (tl.broadcast_to(x4 + 192*tmp66, [YBLOCK, XBLOCK])), tmp68, xmask & ymask)
