"""Each engine path's interface (`kvjax.compression.protocols`) and the generic wrapper
(`kvjax.compression.wrapper`): what a new method family must implement is declared, checked
when a method is made, and forwarded by a wrapper."""

from __future__ import annotations

import dataclasses
import inspect
from typing import ClassVar

import pytest

from kvjax import methods
from kvjax.compression import protocols
from kvjax.compression.method import Method
from kvjax.compression.wrapper import Wrapper
from kvjax.methods.critical.rule import Critical


@pytest.mark.parametrize("name", methods.names())
def test_every_method_has_its_engine_path_s_hooks(name):
    m = methods.create(name)
    want = protocols.REQUIRED.get(m.prefill_kind)
    if want is not None:
        assert isinstance(m, want), protocols.missing(m, want)


def test_a_method_without_its_path_s_hooks_is_refused_naming_them():
    @dataclasses.dataclass(frozen=True)
    class Half(Method):
        prefill_kind: ClassVar[str] = "token_selection"

        def token_plan(self, n):
            return None

    with pytest.raises(TypeError, match=r"Half: prefill_kind='token_selection' needs the "
                                        r"TokenSelection hooks .*missing: token_scores, "
                                        r"init_exit, exit_test, exit_stats"):
        Half()


def test_the_wrapper_forwards_every_hook_of_method():
    """A hook added to `Method` and not forwarded by `Wrapper` would silently run the
    base class's default under every wrapper."""
    hooks = [n for n, f in vars(Method).items()
             if inspect.isfunction(f) and not n.startswith("_")]
    assert len(hooks) > 20
    assert [n for n in hooks if n not in vars(Wrapper)] == []


def test_a_wrapper_answers_as_its_base():
    base = methods.create("asl").for_prompt(512)  # token selection: its protocol's hooks too
    w = Wrapper(base=base)
    assert (w.prefill_kind, w.positional, w.kept_slots(512)) == \
        (base.prefill_kind, base.positional, base.kept_slots(512))
    assert isinstance(w, protocols.TokenSelection) and w.token_plan(512) == base.token_plan(512)
    assert w.with_budget(7).base == base.with_budget(7)
    assert w.for_prompt(300).base == base.for_prompt(300)
    assert Wrapper(base=methods.create("asl")).for_prompt(512) == w
    assert w.name == "wrapper(asl)"
    # the base's fields stay the base's: code that rebuilds a method asks hasattr
    assert not hasattr(w, "select_k") and not hasattr(Critical(), "budget")
    for proto in (protocols.TokenSelection, protocols.BlockPruning):  # every hook forwarded
        assert protocols.missing(Wrapper(), proto) == []


def test_critical_takes_bases_by_interface_not_family():
    from kvjax.config import ModelConfig  # noqa: F401  (validate's cfg is unused for this)

    ok = {n: Critical(base=methods.create(n)) for n in ("snapkv", "ada_snapkv", "lava", "cake")}
    assert {n: c._at_finalize for n, c in ok.items()} == \
        {"snapkv": False, "ada_snapkv": False, "lava": True, "cake": True}
    for n in ("h2o", "asl", "full"):
        with pytest.raises(ValueError, match=rf"critical: base='{n}' does not select per head"):
            Critical(base=methods.create(n)).validate(512, None)


@pytest.mark.parametrize("name", methods.names())
def test_the_budget_is_a_question_the_method_answers(name):
    """`takes_budget` is whether `--budget` changes the method; `budget_for(n)` is the budget
    a record reports: the one given, whichever field the method keeps it in (ASL's and
    GemFilter's `select_k`, a wrapper's base)."""
    m = methods.create(name)
    assert m.takes_budget() == (m.with_budget(1) != m.with_budget(2))
    if m.takes_budget():
        assert m.with_budget(64).budget_for(512) == 64
        assert m.with_ratio(0.75, 512).budget_for(512) == 128  # kvpress: int(n (1 - r))
    else:
        assert m.budget_for(512) is None
