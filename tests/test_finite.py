"""algorithms/finite.py: which rows and values are NaN or infinite, and the words that name them (hand values)."""

from __future__ import annotations

import math

import torch

from ppoflow.algorithms.finite import describe_rows, describe_values, nonfinite_rows, nonfinite_values

NAN, INF = math.nan, math.inf


def test_nonfinite_rows_gives_each_bad_row_and_its_first_bad_value():
    values = torch.tensor([[0.0, 1.0, 2.0], [0.0, INF, NAN], [3.0, 4.0, 5.0], [-INF, 0.0, 0.0], [NAN, 0.0, 0.0]])
    found = nonfinite_rows(values)
    assert [row for row, _ in found] == [1, 3, 4]
    assert found[0][1] == INF and found[1][1] == -INF and math.isnan(found[2][1])


def test_nonfinite_rows_of_a_finite_or_one_dimensional_tensor():
    assert nonfinite_rows(torch.zeros(4, 2)) == []
    assert nonfinite_rows(torch.tensor([1.0, -INF, 2.0])) == [(1, -INF)]


def test_describe_rows_names_row_uid_source_and_value_and_counts_the_rest():
    found = [(1, NAN), (3, INF), (4, -INF), (6, NAN)]
    columns = {"uid": ["a", "b", "c", "d", "e", "f", "g", "h"], "data_source": ["s"] * 8}
    assert describe_rows("reward", found, 8, columns, limit=2) == (
        "non-finite reward in 4 of 8 samples: row 1 (uid 'b', data_source 's') = nan; "
        "row 3 (uid 'd', data_source 's') = inf; and 2 more"
    )
    assert describe_rows("advantages", [(0, -INF)], 2, {}) == "non-finite advantages in 1 of 2 samples: row 0 = -inf"


def test_nonfinite_values_and_their_description():
    values = {"actor/pg_loss": NAN, "actor/entropy": 1.5, "actor/grad_norm": INF, "actor/kl": -INF}
    assert list(nonfinite_values(values)) == ["actor/pg_loss", "actor/grad_norm", "actor/kl"]
    assert describe_values(values) == "actor/pg_loss = nan, actor/grad_norm = inf, actor/kl = -inf"
    assert nonfinite_values({"a": 0.0, "b": -1e38}) == {} and describe_values({"a": 0.0}) == ""
