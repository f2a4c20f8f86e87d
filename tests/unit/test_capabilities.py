"""``Sparsifier.CAPABILITIES``: what each registered class declares, and that the torch entry points'
``"auto"`` choices follow the declaration rather than the sparsifier's name."""
import dataclasses

import pytest

from exdyna_mpi.sparsifiers import REGISTRY
from exdyna_mpi.sparsifiers.capabilities import Capabilities

torch = pytest.importorskip("torch")
from exdyna_mpi.adapters.torch_adam import AgedDecoupledMomentum, make_adam_path, tuned_defaults  # noqa: E402
from exdyna_mpi.adapters._torch_options import auto_momentum  # noqa: E402


def test_capabilities_are_frozen_and_declared_per_class():
    caps = REGISTRY["exdyna"].CAPABILITIES
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.tuned_defaults = False
    assert all(isinstance(cls.CAPABILITIES, Capabilities) for cls in REGISTRY.values())
    assert {n for n, c in REGISTRY.items() if not c.CAPABILITIES.device_step} == {"fft", "oktopk"}
    assert {n for n, c in REGISTRY.items() if c.CAPABILITIES.sign_output} == \
        {n for n, c in REGISTRY.items() if c.CAPABILITIES.wire_half} - {"dense"}


def test_only_exdyna_declares_the_tuned_defaults():
    # MiCRO subclasses ExDyna: it declares its own capabilities, so it does not inherit the tuning
    assert [n for n in sorted(REGISTRY) if tuned_defaults(n)] == ["exdyna"]
    assert not tuned_defaults(None) and not tuned_defaults("no-such-sparsifier")


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_auto_follows_the_capability(name):
    model = torch.nn.Linear(4, 3)
    params = list(model.parameters())
    adamw = torch.optim.AdamW(params, lr=1e-3)
    path = make_adam_path(adamw, params, "auto", sparsifier=name)
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    moved = auto_momentum(sgd, name, 0.01)
    if REGISTRY[name].CAPABILITIES.tuned_defaults:
        assert isinstance(path, AgedDecoupledMomentum) and moved == 0.9
    else:
        assert path is None and moved == 0.0
