"""``Topology.from_mesh`` refuses what it cannot use, naming the argument."""

from __future__ import annotations

from typing import Any

import pytest

from kaisa import Topology


class FakeMesh:
    """Only what from_mesh validates before it touches process groups."""

    mesh_dim_names = ("dp", "tp")

    def get_group(self, name: str | None = None) -> Any:
        raise AssertionError("validation must come before any group is read")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dp="data"), r"dp=\['data'\] must name dimensions of the mesh; its dimensions are"),
        (dict(dp="dp", tp="model"), r"tp=\['model'\] must name"),
        (dict(dp="dp", pp="stage"), r"pp=\['stage'\] must name"),
        (dict(dp=()), r"dp=\[\] must name"),
        (dict(dp="dp", tp="dp"), "must be different dimensions"),
    ],
)
def test_bad_dimension_names(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Topology.from_mesh(FakeMesh(), **kwargs)


def test_not_a_mesh() -> None:
    with pytest.raises(TypeError, match="needs a DeviceMesh with mesh_dim_names"):
        Topology.from_mesh(object())


def test_dp_mesh_must_be_one_dimensional() -> None:
    with pytest.raises(ValueError, match="one-dimensional DeviceMesh"):
        Topology(dp_mesh=FakeMesh())
