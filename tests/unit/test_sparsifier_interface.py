"""The sparsifier's declared interface on one rank: the agreed configuration text, ``Stats``,
``Option`` and ``SparsifierConfig``, ``Balance`` and its one dispatch, and an injected memory and
exchange being the ones a step uses.

The configuration texts below are what the constructors agreed on before ``SparsifierConfig``
existed; state dicts and the step identities depend on them, so the same arguments must still
give the same text, byte for byte.
"""
import dataclasses

import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.algorithm import Balance, BlockLayout, BlockLoad
from exdyna_mpi.sparsifiers import REGISTRY, ErrorFeedback, Option, SparsifierConfig, Stats, positive_int
from exdyna_mpi.transport import Exchange

_TAIL = "wire_dtype=None output='mean' "
#: (name, options, text) at numel=1000, density=0.01, device="auto", nonfinite="raise"
TEXTS = [
    ("cltk", {}, "cltk numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL
     + "deadline_ms=None max_loss=0.01"),
    ("dense", {}, "dense numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL),
    ("dgc", {}, "dgc numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL + "sample_ratio=0.01"),
    ("exdyna", {}, "exdyna numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL
     + "balance=True block_align=32 controller='measured' deadline_ms=None max_imbalance=None max_loss=0.01 "
       "n_blocks=1024"),
    ("fft", {}, "fft numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL + "bits=8 block=4096"),
    ("gaussiank", {}, "gaussiank numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL),
    ("micro", {}, "micro numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL
     + "controller='faithful' deadline_ms=None max_loss=0.01"),
    ("oktopk", {}, "oktopk numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL
     + "global_period=32 local_period=32 region_period=64 warmup=0"),
    ("threshold", {}, "threshold numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL
     + "deadline_ms=None max_loss=0.01 threshold=None"),
    ("topk", {}, "topk numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL
     + "deadline_ms=None max_loss=0.01"),
    ("exdyna", {"balance": "faithful"}, "exdyna numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL
     + "balance='faithful' block_align=32 controller='measured' deadline_ms=None max_imbalance=None "
       "max_loss=0.01 n_blocks=1024"),
    ("exdyna", {"balance": False}, "exdyna numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL
     + "balance=False block_align=32 controller='measured' deadline_ms=None max_imbalance=None max_loss=0.01 "
       "n_blocks=1024"),
    ("exdyna", {"balance": np.bool_(True)}, "exdyna numel=1000 density=0.01 nonfinite='raise' device='auto' "
     + _TAIL + "balance=np.True_ block_align=32 controller='measured' deadline_ms=None max_imbalance=None "
               "max_loss=0.01 n_blocks=1024"),
    ("exdyna", {"max_imbalance": 0.05, "deadline_ms": 50, "max_loss": 0.02},
     "exdyna numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL + "balance=True block_align=32 "
     "controller='measured' deadline_ms=50 max_imbalance=0.05 max_loss=0.02 n_blocks=1024"),
    ("exdyna", {"deadline_ms": "auto", "wire_dtype": "bfloat16", "output": "sign"},
     "exdyna numel=1000 density=0.01 nonfinite='raise' device='auto' wire_dtype='bfloat16' output='sign' "
     "balance=True block_align=32 controller='measured' deadline_ms='auto' max_imbalance=None max_loss=0.01 "
     "n_blocks=1024"),
    ("exdyna", {"n_blocks": np.int64(64), "max_imbalance": 1},
     "exdyna numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL + "balance=True block_align=32 "
     "controller='measured' deadline_ms=None max_imbalance=1 max_loss=0.01 n_blocks=np.int64(64)"),
    ("micro", {"controller": "symmetric", "deadline_ms": 10.5},
     "micro numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL
     + "controller='symmetric' deadline_ms=10.5 max_loss=0.01"),
    ("topk", {"deadline_ms": 1000.0, "max_loss": 0}, "topk numel=1000 density=0.01 nonfinite='raise' device='auto' "
     + _TAIL + "deadline_ms=1000.0 max_loss=0"),
    ("cltk", {"wire_dtype": "float16"}, "cltk numel=1000 density=0.01 nonfinite='raise' device='auto' "
     "wire_dtype='float16' output='mean' deadline_ms=None max_loss=0.01"),
    ("threshold", {"threshold": 0.001}, "threshold numel=1000 density=0.01 nonfinite='raise' device='auto' "
     + _TAIL + "deadline_ms=None max_loss=0.01 threshold=0.001"),
    ("dgc", {"sample_ratio": 0.05}, "dgc numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL
     + "sample_ratio=0.05"),
    ("oktopk", {"local_period": 2, "global_period": 2, "region_period": 3, "warmup": 1},
     "oktopk numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL
     + "global_period=2 local_period=2 region_period=3 warmup=1"),
    ("fft", {"block": 64, "bits": 16}, "fft numel=1000 density=0.01 nonfinite='raise' device='auto' " + _TAIL
     + "bits=16 block=64"),
    ("dense", {"wire_dtype": "float32"}, "dense numel=1000 density=0.01 nonfinite='raise' device='auto' "
     "wire_dtype='float32' output='mean' "),
    ("gaussiank", {"output": "sign"}, "gaussiank numel=1000 density=0.01 nonfinite='raise' device='auto' "
     "wire_dtype=None output='sign' "),
]


@pytest.mark.parametrize("name,options,text", TEXTS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(TEXTS)])
def test_the_agreed_text_is_todays_for_the_same_arguments(name, options, text):
    assert exdyna_mpi.make(name, 1000, 0.01, MPI.COMM_SELF, **options).config.text == text


def test_the_text_keeps_each_argument_as_given():
    sp = exdyna_mpi.make("topk", np.int64(1000), np.float32(0.5), MPI.COMM_SELF)
    assert sp.config.text == ("topk numel=np.int64(1000) density=0.5 nonfinite='raise' device='auto' "
                              "wire_dtype=None output='mean' deadline_ms=None max_loss=0.01")
    assert sp.numel == 1000 and type(sp.numel) is int
    sp = exdyna_mpi.ExDyna(4096, 0.25, MPI.COMM_SELF, device="cpu", nonfinite="skip", balance="blocks",
                           max_imbalance=0.2)
    assert sp.config.text == ("exdyna numel=4096 density=0.25 nonfinite='skip' device='cpu' wire_dtype=None "
                              "output='mean' balance='blocks' block_align=32 controller='measured' "
                              "deadline_ms=None max_imbalance=0.2 max_loss=0.01 n_blocks=1024")


def test_the_config_is_frozen_and_read_only():
    sp = exdyna_mpi.ExDyna(4096, 0.01, MPI.COMM_SELF, n_blocks=np.int64(64))
    assert isinstance(sp.config, SparsifierConfig) and sp.options is sp.config.options
    assert type(sp.options["n_blocks"]) is np.int64   # kept as given, never normalised
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.config.density = 0.5
    with pytest.raises(TypeError):
        sp.config.options["n_blocks"] = 8
    assert sp.state_dict()["options"]["n_blocks"] == 64 and isinstance(sp.state_dict()["options"], dict)


def test_an_option_check_raises_and_its_text_completes_the_name():
    with pytest.raises(ValueError, match="must be a positive integer"):
        positive_int(0)
    assert positive_int(np.int64(3)) is None
    opt = Option(4, positive_int, "a period")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.default = 5
    with pytest.raises(exdyna_mpi.CollectiveError, match="n_blocks must be a positive integer, got 0"):
        exdyna_mpi.ExDyna(4096, 0.01, MPI.COMM_SELF, n_blocks=0)


def test_every_declared_option_is_an_option_with_a_doc_line():
    for name, cls in sorted(REGISTRY.items()):
        for key, option in cls.OPTIONS.items():
            assert isinstance(option, Option) and option.doc.strip(), (name, key)
            option.check(option.default)   # the default passes its own check


def test_stats_fields_extras_and_mapping_reads():
    st = Stats(iteration=3, bytes_sent=10, bytes_received=12, seconds={"total": 0.1}, skipped=False,
               counts=np.array([1, 2]), selected=3, density=0.3, union=3, build_up=1.5)
    assert st.keys() == list(Stats.FIELDS) + ["union", "build_up"]
    assert Stats.FIELDS == tuple(f.name for f in dataclasses.fields(Stats) if f.name != "extra")
    assert st["selected"] == st.selected == 3 and st["union"] == st.union == st.extra["union"] == 3
    assert st.as_dict()["build_up"] == 1.5 and st.as_dict()["iteration"] == 3 and st.imbalance is None
    with pytest.raises(KeyError):
        st["nothing"]
    with pytest.raises(AttributeError):
        st.nothing
    with pytest.raises(AttributeError):   # fields are declared: no attribute is made by assignment
        st.nothing = 1
    assert "seconds" not in repr(st) and "union=3" in repr(st)


def test_a_steps_stats_hold_the_sparsifiers_own_fields_in_extra():
    sp = exdyna_mpi.make("topk", 1000, 0.05, MPI.COMM_SELF)
    sp.step(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    st = sp.stats
    assert set(st.extra) == {"thresholds", "union", "build_up"} and st.union == st.selected
    assert st.keys()[:len(Stats.FIELDS)] == list(Stats.FIELDS) and not st.skipped and st.imbalance == 0.0


def test_balance_takes_todays_spellings_and_a_member():
    assert Balance.of(True) is Balance.AUTO and Balance.of(np.bool_(False)) is Balance.OFF
    assert Balance.of("blocks") is Balance.BLOCKS and Balance.of(Balance.ADAPTIVE) is Balance.ADAPTIVE
    assert Balance.of(True, Balance.FAITHFUL) is Balance.FAITHFUL and Balance.of(Balance.AUTO, Balance.BLOCKS) \
        is Balance.BLOCKS
    for bad in (1, 0, "off", "auto", None, "Faithful"):
        with pytest.raises(ValueError, match="must be True, False, 'faithful', 'adaptive', 'blocks'"):
            Balance.of(bad)
    sp = exdyna_mpi.ExDyna(4096, 0.01, MPI.COMM_SELF, controller="faithful", balance=Balance.ADAPTIVE)
    assert sp.rebalancing is Balance.ADAPTIVE and sp.options["balance"] is Balance.ADAPTIVE
    with pytest.raises(exdyna_mpi.CollectiveError, match="balance must be True, False, .*got 1"):
        exdyna_mpi.ExDyna(4096, 0.01, MPI.COMM_SELF, balance=1)


def test_balance_dispatches_each_rule_to_its_layout_move():
    counts = [900, 100, 300, 50]
    load = BlockLoad(np.arange(64, dtype=np.int64) ** 2)
    moves = {
        Balance.OFF: lambda lay: None,
        Balance.FAITHFUL: lambda lay: lay.rebalance_faithful(counts, 2),
        Balance.ADAPTIVE: lambda lay: lay.rebalance_adaptive(counts, 2),
        Balance.BLOCKS: lambda lay: lay.rebalance_blocks(None, 2, counts=load.counts),
    }
    for rule, move in moves.items():
        a, b = BlockLayout(64 * 50, 4, 64, 1), BlockLayout(64 * 50, 4, 64, 1)
        rule.rebalance(a, counts, 2, load)
        move(b)
        assert a.blk_part == b.blk_part, rule
        assert (a.blk_part != BlockLayout(64 * 50, 4, 64, 1).blk_part) is (rule is not Balance.OFF), rule
    c = BlockLayout(64 * 50, 4, 64, 1)
    Balance.BLOCKS.rebalance(c, counts, 2)   # no load counted: nothing moves
    assert c.blk_part == BlockLayout(64 * 50, 4, 64, 1).blk_part


class CountingMemory(ErrorFeedback):
    """An error-feedback memory that counts the template's calls."""

    def __init__(self, numel):
        super().__init__(numel)
        self.calls = {"take": 0, "commit": 0, "keep": 0}

    def take(self):
        self.calls["take"] += 1
        return super().take()

    def commit(self, acc, out):
        self.calls["commit"] += 1
        return super().commit(acc, out)

    def keep(self, acc):
        self.calls["keep"] += 1
        super().keep(acc)


class CountingExchange(Exchange):
    """A host exchange that counts its first-collective calls."""

    def __init__(self, comm):
        super().__init__(comm)
        self.agreed = 0

    def agree(self, words):
        self.agreed += 1
        return super().agree(words)


@pytest.mark.parametrize("name", ["topk", "exdyna"])
def test_an_injected_memory_and_exchange_are_the_ones_used(name):
    memory, exchange = CountingMemory(2000), CountingExchange(MPI.COMM_SELF)
    sp = exdyna_mpi.make(name, 2000, 0.02, memory=memory, exchange=exchange)
    ref = exdyna_mpi.make(name, 2000, 0.02, MPI.COMM_SELF)
    assert sp.memory is memory and sp.exchange is exchange and sp.comm is MPI.COMM_SELF
    after_init = exchange.agreed
    rng = np.random.default_rng(1)
    for _ in range(3):
        g = rng.standard_normal(2000).astype(np.float32)
        assert sp.step(g.copy()).tobytes() == ref.step(g.copy()).tobytes()
    assert memory.calls["take"] == 3 and memory.calls["commit"] == 3
    assert exchange.agreed >= after_init + 3
    assert sp.residual.tobytes() == ref.residual.tobytes() and memory.residual is not None
    bad = rng.standard_normal(2000).astype(np.float32)
    bad[4] = np.nan
    with pytest.raises(exdyna_mpi.StepError, match="non-finite"):
        sp.step(bad)
    assert memory.calls["keep"] == 1 and sp.iteration == 3


def test_a_memory_of_another_length_is_refused():
    with pytest.raises(exdyna_mpi.CollectiveError, match="memory holds 10 elements, numel is 2000"):
        exdyna_mpi.make("topk", 2000, 0.02, MPI.COMM_SELF, memory=ErrorFeedback(10))
