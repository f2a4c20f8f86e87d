"""The registry of Adam paths (``exdyna_mpi.adapters.torch_adam``): every ``adam=`` name but
``"auto"`` and ``"live"`` has one class, each class declares what it needs, and ``check_mode`` and
``make_adam_path`` follow those declarations. No MPI: the paths are built on one process."""
import pytest

torch = pytest.importorskip("torch")
from exdyna_mpi.adapters import torch_adam  # noqa: E402
from exdyna_mpi.adapters.torch_adam import (ADAM_PATHS, CHOICES, MODES, PATH_CLASSES, AdamPath,  # noqa: E402
                                            AgedDecoupledMomentum, DecoupledMomentum, FrozenVarianceAdam,
                                            LocalUpdateAdam, check_mode, make_adam_path)

#: what each mode needs, written out here rather than read from the classes: (Adam/AdamW only, a dense warm-up)
NEEDS = {"update": (True, False), "frozen": (True, True), "frozen-gradient": (True, True),
         "demo": (True, False), "demo-age": (True, False)}
CLASS_OF = {"update": LocalUpdateAdam, "frozen": FrozenVarianceAdam, "frozen-gradient": FrozenVarianceAdam,
            "demo": DecoupledMomentum, "demo-age": AgedDecoupledMomentum}


class _MyAdamW(torch.optim.AdamW):
    """A subclass counts as AdamW."""


def _params():
    return list(torch.nn.Linear(4, 3).parameters())


def _optimizers():
    return {"sgd": torch.optim.SGD(_params(), lr=0.1), "adam": torch.optim.Adam(_params()),
            "adamw": torch.optim.AdamW(_params()), "subclass": _MyAdamW(_params())}


def test_the_registry_holds_every_choice_but_auto_and_live():
    assert set(ADAM_PATHS) == set(CHOICES) - {"auto", "live"}
    # the order is that of the error messages
    assert MODES == ("live", "update", "frozen", "frozen-gradient", "demo", "demo-age")
    assert CHOICES == ("auto",) + MODES
    assert {m: ADAM_PATHS[m] for m in ADAM_PATHS} == CLASS_OF
    assert set(PATH_CLASSES) == set(CLASS_OF.values())


@pytest.mark.parametrize("mode", sorted(NEEDS))
def test_each_class_declares_its_mode_and_needs(mode):
    cls = ADAM_PATHS[mode]
    assert issubclass(cls, AdamPath) and mode in cls.modes
    assert (cls.needs_adam, cls.needs_warmup) == NEEDS[mode]
    # one class per name: no other class claims it
    assert [c for c in PATH_CLASSES if mode in c.modes] == [cls]


def test_the_package_exports_the_names_the_entry_points_use():
    for name in ("ADAM_KEY", "MODES", "CHOICES", "AdamPath", "make_adam_path", "check_mode", "tuned_defaults",
                 "is_adam", "LocalUpdateAdam", "DecoupledMomentum", "AgedDecoupledMomentum", "FrozenVarianceAdam"):
        assert name in torch_adam.__all__ and hasattr(torch_adam, name), name
    assert torch_adam.ADAM_KEY == "exdyna_adam"


def _expected_refusal(mode, opt_name, warmup):
    """The message ``check_mode`` must raise, from the table above (None: accepted)."""
    if mode not in CHOICES:
        return "adam must be one of"
    if mode in ("auto", "live"):
        return None
    needs_adam, needs_warmup = NEEDS[mode]
    if needs_adam and opt_name == "sgd":
        return "needs torch.optim.Adam or AdamW"
    if needs_warmup and not (isinstance(warmup, int) and warmup >= 1):
        return "warmup_steps >= 1"
    return None


@pytest.mark.parametrize("mode", CHOICES + ("lamb", "frozen-variance"))
@pytest.mark.parametrize("warmup", [0, 1, 3, None, 2.0])
def test_check_mode_refuses_exactly_what_the_declarations_say(mode, warmup):
    for opt_name, opt in _optimizers().items():
        expected = _expected_refusal(mode, opt_name, warmup)
        if expected is None:
            check_mode(opt, mode, warmup, "Entry")
        else:
            with pytest.raises(ValueError, match=expected) as e:
                check_mode(opt, mode, warmup, "Entry")
            assert str(e.value).startswith("Entry: "), str(e.value)


def test_check_mode_reads_the_class_declaration(monkeypatch):
    adamw = torch.optim.AdamW(_params())
    check_mode(adamw, "update", 0, "Entry")
    monkeypatch.setattr(LocalUpdateAdam, "needs_warmup", True)
    with pytest.raises(ValueError, match="warmup_steps >= 1"):
        check_mode(adamw, "update", 0, "Entry")
    monkeypatch.setattr(LocalUpdateAdam, "needs_adam", False)
    check_mode(torch.optim.SGD(_params(), lr=0.1), "update", 1, "Entry")


@pytest.mark.parametrize("mode", sorted(NEEDS))
def test_make_adam_path_builds_the_registered_class(mode):
    params = _params()
    path = make_adam_path(torch.optim.AdamW(params), params, mode, "Entry", sparsifier="exdyna")
    assert type(path) is CLASS_OF[mode] and path.mode == mode and path.who == "Entry"
    assert path.numel == sum(p.numel() for p in params)


def test_live_and_auto():
    params = _params()
    adamw = torch.optim.AdamW(params)
    assert make_adam_path(adamw, params, "live", sparsifier="exdyna") is None
    assert type(make_adam_path(adamw, params, "auto", sparsifier="exdyna")) is AgedDecoupledMomentum
    assert make_adam_path(adamw, params, "auto", sparsifier="topk") is None
    assert make_adam_path(torch.optim.SGD(params, lr=0.1), params, "auto", sparsifier="exdyna") is None
    # where the aged path refuses the optimizer, "auto" leaves it to "live"; asked for, it is refused
    amsgrad = torch.optim.AdamW(params, amsgrad=True)
    assert make_adam_path(amsgrad, params, "auto", sparsifier="exdyna") is None
    with pytest.raises(ValueError, match="amsgrad"):
        make_adam_path(amsgrad, params, "demo-age", sparsifier="exdyna")
    groups = torch.optim.AdamW([{"params": params[:1], "betas": (0.9, 0.999)},
                                {"params": params[1:], "betas": (0.99, 0.999)}])
    assert make_adam_path(groups, params, "auto", sparsifier="exdyna") is None
    with pytest.raises(ValueError, match="one betas"):
        make_adam_path(groups, params, "demo", sparsifier="exdyna")


def test_unknown_modes_are_refused():
    params = _params()
    with pytest.raises(ValueError, match="adam must be one of"):
        make_adam_path(torch.optim.AdamW(params), params, "lamb")
    with pytest.raises(ValueError, match="FrozenVarianceAdam runs adam='frozen' or 'frozen-gradient'"):
        FrozenVarianceAdam(torch.optim.AdamW(params), params, "update")
    with pytest.raises(ValueError, match="LocalUpdateAdam runs adam='update'"):
        LocalUpdateAdam(torch.optim.AdamW(params), params, "frozen")
