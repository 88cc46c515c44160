"""post on its own: what each kind of request gets back from the outputs of its batches."""

from __future__ import annotations

import numpy as np
import pytest

from warmgate_server.post import finish
from warmgate_server.schemas import EmbedRequest, Output

RNG = np.random.default_rng(7)
POOLED = [RNG.normal(size=8).astype(np.float32) for _ in range(3)]


def test_dimensions_are_cut_before_normalising() -> None:
    """Matryoshka: the first components, renormalised; not the first components of the
    normalised whole vector."""
    vectors = finish(POOLED, EmbedRequest(["a", "b", "c"], normalize=True, dimensions=4))
    expected = np.stack(POOLED)[:, :4]
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(vectors, expected, rtol=1e-6)
    assert vectors.dtype == np.float32


def test_without_normalize_the_vectors_are_the_module_chains_own() -> None:
    vectors = finish(POOLED, EmbedRequest(["a", "b", "c"], normalize=False))
    np.testing.assert_array_equal(vectors, np.stack(POOLED))


def test_a_zero_vector_stays_zero_when_normalised() -> None:
    zero = np.zeros(8, dtype=np.float32)
    vectors = finish([zero, POOLED[0]], EmbedRequest(["a", "b"], normalize=True))
    assert not vectors[0].any() and np.isfinite(vectors).all()


@pytest.mark.parametrize("normalize", [False, True])
def test_token_states_are_per_input_and_normalised_per_token_when_asked(normalize: bool) -> None:
    states = [RNG.normal(size=(length, 8)).astype(np.float32) for length in (3, 5)]
    request = EmbedRequest(["a", "b"], normalize=normalize, output=Output.TOKENS, dimensions=4)
    got = finish(states, request)
    assert [item.shape for item in got] == [(3, 8), (5, 8)]  # `dimensions` is for vectors
    for item, raw in zip(got, states, strict=True):
        norms = np.linalg.norm(item, axis=1)
        if normalize:
            np.testing.assert_allclose(norms, 1.0, rtol=1e-6)
            np.testing.assert_allclose(item * np.linalg.norm(raw, axis=1)[:, None], raw, rtol=1e-5)
        else:
            np.testing.assert_array_equal(item, raw)


def test_similarity_is_the_first_inputs_cosine_with_each_other() -> None:
    source, *others = POOLED
    scores = finish(POOLED, EmbedRequest(["s", "a", "b"], True, output=Output.SIMILARITY))
    expected = [
        float(source @ other / (np.linalg.norm(source) * np.linalg.norm(other))) for other in others
    ]
    np.testing.assert_allclose(scores, expected, rtol=1e-5)
    same_direction = EmbedRequest(["s", "a"], True, output=Output.SIMILARITY)
    assert finish([source, source * 3], same_direction)[0] == pytest.approx(1.0)
