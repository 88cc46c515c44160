"""Padding maths: every shape the server can produce is a planned shape."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from warmgate_contract.shapes import Shape, plan_warmup
from warmgate_server.bucketing import ShapePolicy, bucket_for

ascending = st.lists(st.integers(1, 512), min_size=1, max_size=6, unique=True).map(sorted)


@given(length=st.integers(1, 600), buckets=ascending)
def test_bucket_is_the_smallest_that_fits(length: int, buckets: list[int]) -> None:
    bucket = bucket_for(length, buckets)
    if bucket is None:
        assert length > buckets[-1]
    else:
        assert bucket >= length and all(b < length for b in buckets if b < bucket)


@given(
    sizes=ascending.map(lambda values: [1, *[v for v in values if v > 1]]),
    buckets=ascending.map(lambda values: [value + 1 for value in values]),
    data=st.data(),
)
def test_padded_batches_are_always_planned_shapes(sizes, buckets, data) -> None:
    max_batch_tokens = data.draw(st.integers(buckets[-1], 40000))
    max_batch_size = max(sizes)
    plan = plan_warmup(sizes, buckets, max_batch_tokens, max_batch_size)
    policy = ShapePolicy.build(buckets, max_batch_size, max_batch_tokens, True, plan.shapes)
    for seq_len in buckets:
        capacity = policy.capacity(seq_len)
        count = data.draw(st.integers(1, capacity))
        shape = policy.shape_for(count, seq_len)
        assert shape in plan.shapes and shape.batch_size >= count
        smaller = [b for b in policy.batch_sizes_for(seq_len) if count <= b < shape.batch_size]
        assert not smaller  # the smallest planned size that holds the batch


def test_without_batch_padding_batches_run_at_their_size() -> None:
    policy = ShapePolicy.build([32, 64], 16, 512, False, [Shape(1, 32), Shape(8, 32)])
    assert policy.shape_for(5, 32) == Shape(5, 32)
    assert policy.capacity(64) == 8  # 8 x 64 = 512 tokens
