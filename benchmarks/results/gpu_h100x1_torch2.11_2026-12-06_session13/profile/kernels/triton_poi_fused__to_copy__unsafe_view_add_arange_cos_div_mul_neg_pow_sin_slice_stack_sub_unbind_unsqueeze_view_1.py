
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 1024}, 
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*i64', 'out_ptr0': '*fp32', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused__to_copy__unsafe_view_add_arange_cos_div_mul_neg_pow_sin_slice_stack_sub_unbind_unsqueeze_view_1', 'mutated_arg_names': [], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 6, 'num_store': 1, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 4608}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused__to_copy__unsafe_view_add_arange_cos_div_mul_neg_pow_sin_slice_stack_sub_unbind_unsqueeze_view_1(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 576
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    x0 = (xindex % 2)
    x3 = xindex // 2
    x1 = ((xindex // 2) % 32)
    x4 = xindex
    tmp0 = x0
    tmp1 = tl.full([1], 0, tl.int64)
    tmp2 = tmp0 >= tmp1
    tmp3 = tl.full([1], 1, tl.int64)
    tmp4 = tmp0 < tmp3
    tmp5 = tl.load(in_ptr0 + (2*x3), tmp4 & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp6 = tmp5.to(tl.float32)
    tmp7 = tl.load(in_ptr1 + (1))
    tmp8 = tl.broadcast_to(tmp7, [XBLOCK])
    tmp9 = tl.where(tmp4, tmp8, 0)
    tmp10 = tmp9.to(tl.float32)
    tmp11 = 2*x1
    tmp12 = tmp11.to(tl.float32)
    tmp13 = tl.full([1], 0.015625, tl.float32)
    tmp14 = tmp12 * tmp13
    tmp15 = -tmp14
    tmp16 = tl.full([1], 100000.0, tl.float32)
    tmp17 = libdevice.pow(tmp16, tmp15)
    tmp18 = tmp10 * tmp17
    tmp19 = tl_math.cos(tmp18)
    tmp20 = tmp6 * tmp19
    tmp21 = tl.load(in_ptr0 + (1 + 2*x3), tmp4 & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp22 = tmp21.to(tl.float32)
    tmp23 = tl_math.sin(tmp18)
    tmp24 = tmp22 * tmp23
    tmp25 = tmp20 - tmp24
    tmp26 = tl.full(tmp25.shape, 0.0, tmp25.dtype)
    tmp27 = tl.where(tmp4, tmp25, tmp26)
    tmp28 = tmp0 >= tmp3
    tmp29 = tl.full([1], 2, tl.int64)
    tmp30 = tmp0 < tmp29
    tmp31 = tl.load(in_ptr0 + (2*x3), tmp28 & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp32 = tmp31.to(tl.float32)
    tmp33 = tl.load(in_ptr1 + (1))
    tmp34 = tl.broadcast_to(tmp33, [XBLOCK])
    tmp35 = tl.where(tmp28, tmp34, 0)
    tmp36 = tmp35.to(tl.float32)
    tmp37 = 2*x1
    tmp38 = tmp37.to(tl.float32)
    tmp39 = tl.full([1], 0.015625, tl.float32)
    tmp40 = tmp38 * tmp39
    tmp41 = -tmp40
    tmp42 = tl.full([1], 100000.0, tl.float32)
    tmp43 = libdevice.pow(tmp42, tmp41)
    tmp44 = tmp36 * tmp43
    tmp45 = tl_math.sin(tmp44)
    tmp46 = tmp32 * tmp45
    tmp47 = tl.load(in_ptr0 + (1 + 2*x3), tmp28 & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp48 = tmp47.to(tl.float32)
    tmp49 = tl_math.cos(tmp44)
    tmp50 = tmp48 * tmp49
    tmp51 = tmp46 + tmp50
    tmp52 = tl.full(tmp51.shape, 0.0, tmp51.dtype)
    tmp53 = tl.where(tmp28, tmp51, tmp52)
    tmp54 = tl.where(tmp4, tmp27, tmp53)
    tl.store(out_ptr0 + (x4), tmp54, xmask)
