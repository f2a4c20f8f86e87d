"""Algorithm layer: threshold controllers.

A controller owns the global threshold. It sees only what every rank sees (the gathered counts),
so every rank computes the same threshold sequence.
"""
import math


def target_count(density, numel):
    """k = int(density * numel), at least 1 (the authors' code divides by it)."""
    return max(1, int(density * numel))


class FaithfulController:
    """The authors' rule (specs/exdyna.md §4): thr0 = 1/(2 sqrt k), then x1.005 / x1.00125 / x0.995."""

    name = "faithful"
    up, creep, down = 1.005, 1.00125, 0.995
    band_hi, band_lo = 1.1, 0.909

    def __init__(self, numel, density):
        self.k = target_count(density, numel)
        self.threshold = 1.0 / (2.0 * math.sqrt(self.k))

    def update(self, counts_prev):
        r = sum(int(c) for c in counts_prev) / self.k
        if r > self.band_hi:
            self.threshold *= self.up
        elif r > self.band_lo:
            self.threshold *= self.creep
        else:
            self.threshold *= self.down

    def state(self):
        return {"threshold": self.threshold}

    def load_state(self, d):
        self.threshold = float(d["threshold"])


class SymmetricController(FaithfulController):
    """The rule the authors' dead branch suggests: x1.00125 above target, x0.9987 below, inside the band."""

    name = "symmetric"

    def update(self, counts_prev):
        r = sum(int(c) for c in counts_prev) / self.k
        if r > self.band_hi:
            self.threshold *= self.up
        elif r > 1.0:
            self.threshold *= self.creep
        elif r > self.band_lo:
            self.threshold *= 0.9987
        else:
            self.threshold *= self.down


class DenseController:
    """density = 1: select everything (threshold 0), whatever the controller asked for."""

    name = "dense"

    def __init__(self, numel, density):
        self.threshold = 0.0

    def update(self, counts_prev):
        pass

    def state(self):
        return {"threshold": self.threshold}

    def load_state(self, d):
        self.threshold = float(d["threshold"])


CONTROLLERS = {c.name: c for c in (FaithfulController, SymmetricController)}


def make_controller(name, numel, density):
    if density >= 1.0:
        return DenseController(numel, density)
    return CONTROLLERS[name](numel, density)
