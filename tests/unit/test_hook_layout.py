"""The DDP hook's canonical parameter layout (``exdyna_mpi/adapters/torch_hook/layout.py``), without
MPI or torch: the parameters are stand-ins with DDP's two reads (``numel()``, ``shape``).

- the first iteration of a model derives the canonical order from its buckets, contiguous
  parameters of a bucket merged into one copy run;
- later iterations find each parameter by identity, whatever bucket and order DDP gives it;
- a new model (other parameter objects) derives afresh and must match the layout already held;
- ``optimizer=``'s fixed order is never derived and must be covered by the buckets;
- a parameter reached twice, a parameter not in the layout, a bucket the parameters do not fill,
  an empty bucket, and the errors' messages.
"""
import math

import pytest

from exdyna_mpi.adapters.torch_hook.layout import LayoutError, ParamLayout, Place, required


class Param:
    """A parameter as the layout reads it: identity, ``numel()`` and ``shape``."""

    def __init__(self, *shape):
        self.shape = shape

    def numel(self):
        return math.prod(self.shape)


def model():
    """Four parameters of 6, 3, 4 and 2 elements."""
    return [Param(2, 3), Param(3), Param(2, 2), Param(2)]


def iterate(layout, buckets):
    """One iteration: every bucket located in order, the last one ends it; the buckets' places."""
    places = []
    for i, params in enumerate(buckets):
        layout.begin(params)
        places.append(layout.locate(params, sum(p.numel() for p in params)))
        if i == len(buckets) - 1:
            layout.end()
    return places


def test_the_first_iteration_derives_the_order_from_the_buckets():
    w, b, v, c = model()
    layout = ParamLayout()
    assert layout.entries is None and layout.total == 0
    places = iterate(layout, [[v, c], [w, b]])
    # canonical order: the order the parameters appear across the buckets
    assert places == [Place((0, 1), [(0, 0, 6)], True), Place((2, 3), [(0, 6, 9)], True)]
    assert layout.entries == [(4, (2, 2)), (2, (2,)), (6, (2, 3)), (3, (3,))]
    assert layout.offsets == [0, 4, 6, 12, 15] and layout.total == 15
    assert all(type(o) is int for o in layout.offsets)
    assert [layout.index_of(p) for p in (v, c, w, b)] == [0, 1, 2, 3]
    assert not layout.in_iteration


def test_later_iterations_find_each_parameter_in_any_bucket_and_order():
    w, b, v, c = model()
    layout = ParamLayout()
    iterate(layout, [[v, c], [w, b]])            # canonical: v c w b at offsets 0 4 6 12
    places = iterate(layout, [[b], [c, w], [v]])   # DDP's rebuild: other buckets, another order
    assert [p.key for p in places] == [(3,), (1, 2), (0,)]
    assert [p.new_model for p in places] == [False, False, False]
    # c (offset 4) and w (offset 6) are contiguous in the model and in the bucket: one run
    assert places[1].runs == [(0, 4, 8)]
    assert places[0].runs == [(0, 12, 3)] and places[2].runs == [(0, 0, 4)]
    # reversed within a bucket: no merge, each parameter its own run
    [place] = iterate(layout, [[b, w, c, v]])
    assert place.key == (3, 2, 1, 0)
    assert place.runs == [(0, 12, 3), (3, 6, 6), (9, 4, 2), (11, 0, 4)]
    assert layout.entries == [(4, (2, 2)), (2, (2,)), (6, (2, 3)), (3, (3,))]


def test_a_new_model_derives_afresh_against_the_layout_held():
    layout = ParamLayout()
    iterate(layout, [model()])
    old = layout.entries
    fresh = model()                               # a resumed run: new parameter objects, same shapes
    places = iterate(layout, [fresh[:2], fresh[2:]])
    assert [p.new_model for p in places] == [True, True] and layout.entries == old
    assert [layout.index_of(p) for p in fresh] == [0, 1, 2, 3]
    # another architecture: the first parameter that differs is named
    other = [Param(2, 3), Param(4)]
    layout.begin(other)
    with pytest.raises(LayoutError, match=r"the model's parameter 1 \(in bucket order\) is \(4, \(4,\)\) "
                                          r"\(numel, shape\), the state's layout has \(3, \(3,\)\)"):
        layout.locate(other, 10)
    layout.abandon()
    assert not layout.in_iteration
    # fewer parameters of the same shapes: refused at the last bucket
    fewer = model()[:3]
    layout.begin(fewer)
    layout.locate(fewer, 13)
    with pytest.raises(LayoutError, match="the model has 3 parameters, the state's layout 4"):
        layout.end()
    assert not layout.in_iteration


def test_a_parameter_reached_twice_while_deriving_is_refused():
    w, b, v, c = model()
    layout = ParamLayout()
    layout.begin([w, b])
    layout.locate([w, b], 9)
    with pytest.raises(LayoutError, match="a parameter appears in two buckets of one iteration"):
        layout.locate([b, v], 7)
    layout.abandon()
    twice = ParamLayout()
    twice.begin([w, w])
    with pytest.raises(LayoutError, match="appears in two buckets"):
        twice.locate([w, w], 12)


def test_a_parameter_not_in_the_layout_is_refused():
    w, b, v, c = model()
    layout = ParamLayout()
    iterate(layout, [[w, b, v, c]])
    stranger = Param(3)
    assert layout.index_of(stranger) is None
    layout.begin([w])                              # a known first bucket: the model seen last
    layout.locate([w], 6)
    with pytest.raises(LayoutError, match="a bucket holds a parameter that was not in this model's first iteration"):
        layout.locate([stranger], 3)


def test_the_fixed_order_is_never_derived_and_must_be_covered():
    w, b, v, c = model()
    layout = ParamLayout([w, b, v, c])              # optimizer=: the optimizer's order from the start
    assert layout.fixed and layout.entries == [(6, (2, 3)), (3, (3,)), (4, (2, 2)), (2, (2,))]
    places = iterate(layout, [[c, v], [b, w]])
    assert [p.key for p in places] == [(3, 2), (1, 0)] and not any(p.new_model for p in places)
    assert places[0].runs == [(0, 13, 2), (2, 9, 4)]
    layout.begin([w])
    with pytest.raises(LayoutError, match="not among the optimizer's parameters"):
        layout.locate([w, Param(2)], 8)
    layout.abandon()
    layout.begin([w, b])
    layout.locate([w, b], 9)
    with pytest.raises(LayoutError, match="DDP's buckets hold 2 parameters, the optimizer 4 that require grad"):
        layout.end()


def test_an_empty_bucket_and_a_bucket_the_parameters_do_not_fill():
    w, b, v, c = model()
    layout = ParamLayout()
    layout.begin([])
    assert layout.locate([], 0) == Place((), [], True)
    with pytest.raises(LayoutError, match=r"a bucket of 5 elements holds parameters of 0 \(sparse gradients"):
        layout.locate([], 5)
    with pytest.raises(LayoutError, match="a bucket of 10 elements holds parameters of 9"):
        layout.locate([w, b], 10)
    assert layout.locate([w, b], 9).key == (0, 1)   # a refused bucket took nothing in
    layout.end()
    assert layout.entries == [(6, (2, 3)), (3, (3,))]


def test_key_offsets_and_runs():
    w, b, v, c = model()
    layout = ParamLayout()
    iterate(layout, [[w, b, v, c]])                 # offsets 0 6 9 13
    assert layout.key_numel((3, 0)) == 8
    assert layout.key_offsets((3, 0)) == {3: 0, 0: 2}
    assert layout.key_runs((3, 0)) == [(13, 2), (0, 6)]
    assert layout.key_numel(()) == 0 and layout.key_runs(()) == []


def test_a_layout_that_must_be_known():
    layout = ParamLayout()
    with pytest.raises(RuntimeError, match="no parameter layout where one must be known"):
        layout.held()
    with pytest.raises(RuntimeError, match="no parameter layout"):
        layout.key_numel((0,))
    with pytest.raises(RuntimeError, match="no parameter layout"):
        required(None)
    layout.set([(6, (2, 3)), (3, (3,))])
    assert layout.held() == [(6, (2, 3)), (3, (3,))] and layout.total == 9
    assert layout.index_of(Param(2, 3)) is None     # a set layout finds no parameter yet: the next model derives
    w, b = Param(2, 3), Param(3)
    assert iterate(layout, [[w, b]])[0].new_model


def test_begin_starts_an_iteration_once():
    w, b, v, c = model()
    layout = ParamLayout()
    assert layout.begin([w]) is True and layout.in_iteration
    assert layout.begin([b]) is False
    layout.locate([w, b, v, c], 15)
    layout.end()
    assert layout.begin([w]) is True


def test_the_layout_module_imports_neither_mpi_nor_torch_nor_the_package():
    import ast
    import pathlib

    from exdyna_mpi.adapters.torch_hook import layout as module

    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    relative = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    assert imported <= {"__future__", "math", "typing", "weakref", "numpy"}, imported
    assert not relative, relative
