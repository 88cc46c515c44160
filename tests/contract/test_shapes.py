"""The warmup plan: the shapes a configuration can produce, within its limits."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from warmgate_contract.shapes import Shape, plan_warmup

ascending = st.lists(st.integers(1, 512), min_size=1, max_size=6, unique=True).map(sorted)


def test_plan_is_the_grid_within_the_token_budget() -> None:
    plan = plan_warmup([1, 8, 32], [32, 64, 128, 256], 4096, 32)
    assert Shape(32, 128) in plan.shapes and Shape(16, 256) not in plan.shapes
    assert Shape(32, 256) not in plan.shapes  # 8192 tokens > 4096
    assert plan.shapes[0] == Shape(1, 32)  # short and small first
    assert len(plan.shapes) == 11


def test_profile_shapes_join_the_plan_or_are_reported_ignored() -> None:
    plan = plan_warmup(
        [1, 8], [32, 64], 1024, 16, [Shape(5, 64), Shape(8, 32), Shape(3, 48), Shape(32, 64)]
    )
    assert Shape(5, 64) in plan.shapes and plan.shapes.count(Shape(8, 32)) == 1
    assert plan.ignored_profile_shapes == (Shape(3, 48), Shape(32, 64))


@given(
    sizes=ascending,
    buckets=ascending.map(lambda values: [value + 1 for value in values]),
    max_batch_tokens=st.integers(2, 20000),
    max_batch_size=st.integers(1, 512),
)
def test_plan_never_exceeds_the_limits(
    sizes: list[int], buckets: list[int], max_batch_tokens: int, max_batch_size: int
) -> None:
    plan = plan_warmup(sizes, buckets, max_batch_tokens, max_batch_size)
    for shape in plan.shapes:
        assert shape.tokens <= max_batch_tokens and shape.batch_size <= max_batch_size
    expected = {
        (b, s) for b in sizes for s in buckets if b <= max_batch_size and b * s <= max_batch_tokens
    }
    assert set(plan.shapes) == expected


def test_a_shape_reads_back_what_it_writes_and_refuses_nonsense() -> None:
    assert Shape.from_json(Shape(8, 64).as_json()) == Shape(8, 64)
    assert Shape(8, 64).key == "8x64" and Shape(8, 64).tokens == 512
    for bad in ({"batch_size": 0, "seq_len": 8}, {"batch_size": True, "seq_len": 8}, {}):
        try:
            Shape.from_json(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")
