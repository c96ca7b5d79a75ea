import os
import re
import sys

if "jax" not in sys.modules:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.analysis import hlo

ROWS, COLS = 128, 256  # per-device block
BLOCK_BYTES = ROWS * COLS * 4


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() >= 8, "tests/conftest.py simulates 8 CPU devices"
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.fixture(scope="module")
def x(mesh):
  return jax.device_put(jnp.ones((8 * ROWS, COLS), jnp.float32), NamedSharding(mesh, P("data")))


def compiled_shard_map(mesh, fn, x, out_specs):
  # check_vma=False: loops carry a value that psum turns from varying into invariant.
  f = jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=out_specs, check_vma=False)
  return jax.jit(f).lower(x).compile()


def only(counts, **expected):
  want = dict.fromkeys(hlo.KINDS, 0)
  want.update({k.replace("_", "-"): v for k, v in expected.items()})
  assert counts == want


def test_psum_is_all_reduce_of_the_block(mesh, x):
  c = compiled_shard_map(mesh, lambda a: jax.lax.psum(a, "data"), x, P())
  only(hlo.collective_bytes(c.as_text()), all_reduce=BLOCK_BYTES)


def test_psum_scatter_counts_the_result_shard(mesh, x):
  c = compiled_shard_map(mesh, lambda a: jax.lax.psum_scatter(a, "data", tiled=True), x, P("data"))
  only(hlo.collective_bytes(c.as_text()), reduce_scatter=BLOCK_BYTES // 8)


def test_all_gather_counts_the_gathered_array(mesh, x):
  c = compiled_shard_map(mesh, lambda a: jax.lax.all_gather(a, "data", tiled=True), x, P())
  only(hlo.collective_bytes(c.as_text()), all_gather=8 * BLOCK_BYTES)


def test_ppermute_is_collective_permute(mesh, x):
  ring = [(i, (i + 1) % 8) for i in range(8)]
  c = compiled_shard_map(mesh, lambda a: jax.lax.ppermute(a, "data", ring), x, P("data"))
  only(hlo.collective_bytes(c.as_text()), collective_permute=BLOCK_BYTES)


def test_all_to_all(mesh, x):
  fn = lambda a: jax.lax.all_to_all(a, "data", 0, 0, tiled=True)
  c = compiled_shard_map(mesh, fn, x, P("data"))
  only(hlo.collective_bytes(c.as_text()), all_to_all=BLOCK_BYTES)


def test_fori_loop_multiplies_by_trip_count(mesh, x):
  def fn(a):
    return jax.lax.fori_loop(0, 5, lambda i, c: jax.lax.psum(c, "data") * 0.5, a)
  c = compiled_shard_map(mesh, fn, x, P())
  only(hlo.collective_bytes(c.as_text()), all_reduce=5 * BLOCK_BYTES)


def test_trip_count_inferred_when_xla_does_not_annotate(mesh, x):
  def fn(a):
    return jax.lax.fori_loop(0, 5, lambda i, c: jax.lax.psum(c, "data") * 0.5, a)
  text = compiled_shard_map(mesh, fn, x, P()).as_text()
  text = re.sub(r'"known_(trip_count|init_step)":\{[^}]*\}', '"x":{}', text)
  assert "known_trip_count" not in text and "known_init_step" not in text
  only(hlo.collective_bytes(text), all_reduce=5 * BLOCK_BYTES)


def test_scan_multiplies_by_length(mesh, x):
  def fn(a):
    return jax.lax.scan(lambda c, _: (jax.lax.psum(c, "data") * 0.5, None), a, None, length=5)[0]
  c = compiled_shard_map(mesh, fn, x, P())
  only(hlo.collective_bytes(c.as_text()), all_reduce=5 * BLOCK_BYTES)


def test_nested_loops_multiply(mesh, x):
  def fn(a):
    inner = lambda i, c: jax.lax.psum(c, "data") * 0.5
    return jax.lax.fori_loop(0, 4, lambda i, c: jax.lax.fori_loop(0, 3, inner, c) + 1.0, a)
  c = compiled_shard_map(mesh, fn, x, P())
  only(hlo.collective_bytes(c.as_text()), all_reduce=12 * BLOCK_BYTES)


def test_flops_and_memory_of_a_sharded_matmul(mesh, x):
  w = jax.device_put(jnp.ones((COLS, 512), jnp.float32), NamedSharding(mesh, P()))
  matmul = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P("data")))
  c = matmul.lower(x, w).compile()
  assert hlo.flops(c) == pytest.approx(2 * ROWS * COLS * 512)
  mem = hlo.memory(c)
  assert set(mem) >= {"argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
                      "generated_code_bytes"}
  assert all(isinstance(v, int) for v in mem.values())
  assert mem["argument_bytes"] == BLOCK_BYTES + COLS * 512 * 4
  assert mem["output_bytes"] == ROWS * 512 * 4


class FakeCompiled:
  def __init__(self, cost=None, stats=None):
    self.cost, self.stats = cost, stats

  def cost_analysis(self):
    return self.cost

  def memory_analysis(self):
    return self.stats


def test_flops_accepts_dict_list_and_nothing():
  assert hlo.flops(FakeCompiled({"flops": 12.0})) == 12.0
  assert hlo.flops(FakeCompiled([{"flops": 7.0, "bytes accessed": 3.0}])) == 7.0
  assert hlo.flops(FakeCompiled({"bytes accessed": 3.0})) == 0.0
  assert hlo.flops(FakeCompiled(None)) is None
  assert hlo.flops(FakeCompiled([])) is None


def test_memory_without_analysis_is_zeros():
  mem = hlo.memory(FakeCompiled(stats=None))
  assert mem["temp_bytes"] == 0 and mem["argument_bytes"] == 0


def test_shape_bytes():
  assert hlo.shape_bytes("f32[8,128]{1,0}") == 8 * 128 * 4
  assert hlo.shape_bytes("bf16[3,5]{0,1:T(8,128)(2,1)}") == 30
  assert hlo.shape_bytes("pred[10]") == 10
  assert hlo.shape_bytes("f64[]") == 8
  assert hlo.shape_bytes("(s8[4], u32[2], /*index=2*/f16[2,2], token[])") == 4 + 8 + 8
  assert hlo.shape_bytes("s4[3]") == 2
  assert hlo.shape_bytes("f32[<=16,2]") == 128


TUPLE_HLO = """
HloModule m

ENTRY %main (p: bf16[64,32]) -> (bf16[8,32], bf16[8,32]) {
  %p = bf16[64,32]{1,0} parameter(0)
  %s0 = bf16[8,32]{1,0} slice(%p), slice={[0:8], [0:32]}
  %s1 = bf16[8,32]{1,0} slice(%p), slice={[8:16], [0:32]}
  ROOT %a2a = (bf16[8,32]{1,0}, bf16[8,32]{1,0}) all-to-all(%s0, %s1), channel_id=1, replica_groups={{0,1}}
}
"""


def test_tuple_result_sums_elements():
  only(hlo.collective_bytes(TUPLE_HLO), all_to_all=2 * 8 * 32 * 2)


ASYNC_HLO = """
HloModule async, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %r = f32[] add(%x, %y)
}

%async_computation (q: bf16[16,8]) -> bf16[16,8] {
  %q = bf16[16,8]{1,0} parameter(0)
  ROOT %a2a = bf16[16,8]{1,0} all-to-all(%q), channel_id=5, replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (p: f32[4,256], b: bf16[16,8]) -> f32[16,256] {
  %p = f32[4,256]{1,0} parameter(0)
  %b = bf16[16,8]{1,0} parameter(1)
  %ars = f32[4,256]{1,0} all-reduce-start(%p), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %ard = f32[4,256]{1,0} all-reduce-done(%ars)
  %ags = (f32[4,256]{1,0}, f32[16,256]{1,0}) all-gather-start(%ard), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = f32[16,256]{1,0} all-gather-done(%ags)
  %cps = (f32[4,256]{1,0}, f32[4,256]{1,0}, u32[], u32[]) collective-permute-start(%p), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[4,256]{1,0} collective-permute-done(%cps)
  %rss = ((f32[16,256]{1,0}), f32[4,256]{1,0}) reduce-scatter-start(%agd), channel_id=4, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %rsd = f32[4,256]{1,0} reduce-scatter-done(%rss)
  %aas = ((bf16[16,8]{1,0}), bf16[16,8]{1,0}, s32[]) async-start(%b), calls=%async_computation
  %aad = bf16[16,8]{1,0} async-done(%aas)
  ROOT %out = f32[16,256]{1,0} add(%agd, %agd)
}
"""


def test_async_pairs_count_once_with_output_size():
  block = 4 * 256 * 4
  only(hlo.collective_bytes(ASYNC_HLO), all_reduce=block, all_gather=4 * block,
       collective_permute=block, reduce_scatter=block, all_to_all=16 * 8 * 2)


LOOPS_HLO = """
HloModule loops

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %r = f32[] add(%x, %y)
}

%inner_body (s: (s32[], f32[32])) -> (s32[], f32[32]) {
  %s = (s32[], f32[32]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[32]{0} get-tuple-element(%s), index=1
  %ar = f32[32]{0} all-reduce(%v), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[32]{0}) tuple(%i1, %ar)
}

%inner_cond (s: (s32[], f32[32])) -> pred[] {
  %s = (s32[], f32[32]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (s: (s32[], f32[32])) -> (s32[], f32[32]) {
  %s = (s32[], f32[32]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[32]{0} get-tuple-element(%s), index=1
  %zero = s32[] constant(0)
  %init = (s32[], f32[32]{0}) tuple(%zero, %v)
  %w = (s32[], f32[32]{0}) while(%init), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %r = f32[32]{0} get-tuple-element(%w), index=1
  %ag = bf16[64]{0} all-gather(%r), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[32]{0}) tuple(%i1, %r)
}

%outer_cond (s: (s32[], f32[32])) -> pred[] {
  %s = (s32[], f32[32]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%branch_a (p: f32[32]) -> f32[32] {
  %p = f32[32]{0} parameter(0)
  ROOT %ar = f32[32]{0} all-reduce(%p), channel_id=3, replica_groups={{0,1}}, to_apply=%add
}

%branch_b (p: f32[32]) -> f32[32] {
  %p = f32[32]{0} parameter(0)
  %ar = f32[32]{0} all-reduce(%p), channel_id=4, replica_groups={{0,1}}, to_apply=%add
  ROOT %ar2 = f32[32]{0} all-reduce(%ar), channel_id=5, replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main (p: f32[32], k: s32[]) -> f32[32] {
  %p = f32[32]{0} parameter(0)
  %k = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %z = s32[] copy(%c0)
  %init = (s32[], f32[32]{0}) tuple(%z, %p)
  %w = (s32[], f32[32]{0}) while(%init), condition=%outer_cond, body=%outer_body
  %r = f32[32]{0} get-tuple-element(%w), index=1
  ROOT %c = f32[32]{0} conditional(%k, %r, %r), branch_computations={%branch_a, %branch_b}
}
"""


def test_nested_while_annotated_and_inferred_and_conditional_max():
  # Outer trip count 4 is read from `i = 0; i < 4; i += 1`, inner 3 from known_trip_count.
  only(hlo.collective_bytes(LOOPS_HLO), all_reduce=4 * 3 * 32 * 4 + 2 * 32 * 4,
       all_gather=4 * 64 * 2)


def test_unreadable_trip_count_counts_once():
  text = LOOPS_HLO.replace("%n = s32[] constant(4)", "%n = s32[] get-tuple-element(%s), index=0")
  only(hlo.collective_bytes(text), all_reduce=3 * 32 * 4 + 2 * 32 * 4, all_gather=64 * 2)


def test_recv_done_is_collective_permute_unless_host_transfer():
  text = """
ENTRY %main (t: token[]) -> f32[8] {
  %t = token[] after-all()
  %r = (f32[8]{0}, u32[], token[]) recv(%t), channel_id=1
  %rd = (f32[8]{0}, token[]) recv-done(%r), channel_id=1
  %h = (f32[2]{0}, u32[], token[]) recv(%t), channel_id=2, is_host_transfer=true
  %hd = (f32[2]{0}, token[]) recv-done(%h), channel_id=2, is_host_transfer=true
  ROOT %v = f32[8]{0} get-tuple-element(%rd), index=0
}
"""
  only(hlo.collective_bytes(text), collective_permute=32)


def test_no_collectives():
  assert hlo.collective_bytes("") == dict.fromkeys(hlo.KINDS, 0)


def test_sent_bytes_follow_the_ring_algorithms(mesh, x):
  # one device sends 2 (n-1)/n of an all-reduce's buffer, (n-1)/n of an all-gather's result and
  # n-1 times a reduce-scatter's result: a reduce-scatter then an all-gather cost one all-reduce
  n = 8
  ar = compiled_shard_map(mesh, lambda a: jax.lax.psum(a, "data"), x, P())
  rs = compiled_shard_map(mesh, lambda a: jax.lax.psum_scatter(a, "data", tiled=True), x, P("data"))
  # gathers what the reduce-scatter left on each device (ROWS / n rows) back into one block
  ag = compiled_shard_map(mesh, lambda a: jax.lax.all_gather(a[:ROWS // n], "data", tiled=True),
                          x, P())
  sent = lambda c, kind: hlo.sent_bytes(c.as_text(), n)[kind]
  assert sent(ar, "all-reduce") == pytest.approx(2 * (n - 1) / n * BLOCK_BYTES)
  assert sent(rs, "reduce-scatter") == pytest.approx((n - 1) * BLOCK_BYTES / n)
  assert sent(ag, "all-gather") == pytest.approx((n - 1) / n * BLOCK_BYTES)
  assert sent(rs, "reduce-scatter") + sent(ag, "all-gather") == pytest.approx(sent(ar, "all-reduce"))


@pytest.mark.parametrize("attrs,size", [
    ("replica_groups={{0,1},{2,3}}, to_apply=%add", 2),
    ("replica_groups=[2,4]<=[8], to_apply=%add", 4),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true", 4),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, to_apply=%add", 8),
    ("replica_groups={}, to_apply=%add", 16),  # every device
])
def test_group_sizes_in_every_form_xla_prints(attrs, size):
  assert hlo._group_size(attrs, 16) == size
