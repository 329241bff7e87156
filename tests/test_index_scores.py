"""index_scores / index_scores_prefill vs the float64 reference; JAX bit-identical to torch."""

import math

import pytest
import torch

from cases import ALL_CASES
from targets import check_twin, grid, reference, run


def check_scores(scores, expected, tol):
    """Finite entries close to the reference, -inf exactly where the reference has it, no NaN."""
    assert scores.dtype == torch.float32 and scores.shape == expected.shape
    assert not torch.isnan(scores).any()
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(scores), finite), "-inf pattern differs from the reference"
    assert (scores[~finite] == -math.inf).all()
    torch.testing.assert_close(scores[finite].double(), expected[finite], rtol=tol, atol=tol)


@pytest.mark.parametrize("case, target", grid(ALL_CASES))
def test_index_scores(case, target):
    scores = run(target, "index_scores", case)
    # float32 accumulation; on the GPU fp32 inputs go through tf32 dots
    tol = 1e-4 if target.device == "interpreter" else (2e-2 if case.dtype == "float32" else 1e-3)
    check_scores(scores, reference("index_scores", case), tol)
    check_twin(target, "index_scores", case)
