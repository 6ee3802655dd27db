"""Which framework an object comes from: by its type's module, answered from a
bounded memo per type, the same answer the first time and every time after."""

from __future__ import annotations

import numpy as np

from kvcopy.interop import frameworks
from kvcopy.interop.frameworks import framework_of


def made_in(module: str, name: str = "Thing") -> type:
    return type(name, (), {"__module__": module})


def test_modules_name_their_framework_and_others_none():
    cases = {
        "torch": "torch",
        "torch.nn.parameter": "torch",
        "cupy._core.core": "cupy",
        "cupy_backends.cuda.api": "cupy",
        "jaxlib.xla_extension": "jax",
        "cuda.core.experimental": "cuda.core",
        "cuda.bindings.driver": "cuda.bindings",
        "torchvision": None,
        "cudatoolkit": None,
        "numpy": None,
        "__main__": None,
    }
    for module, want in cases.items():
        thing = made_in(module)()
        assert framework_of(thing) == want, module
        assert framework_of(thing) == want, module  # the remembered answer too
    assert framework_of(np.zeros(3)) is None and framework_of([1, 2]) is None


def test_the_memo_stays_bounded_and_right():
    made = [made_in("torch" if k % 2 else "elsewhere", f"T{k}") for k in range(3 * frameworks._TYPES_KEPT)]
    for k, kind in enumerate(made):
        assert framework_of(kind()) == ("torch" if k % 2 else None)
        assert len(frameworks._by_type) <= frameworks._TYPES_KEPT


def test_a_class_whose_metaclass_makes_it_unhashable_is_answered():
    class Unhashable(type):
        __hash__ = None  # type: ignore[assignment]

        def __eq__(cls, other):
            return cls is other

    thing = Unhashable("Thing", (), {"__module__": "cupy.cuda"})()
    assert framework_of(thing) == "cupy"
