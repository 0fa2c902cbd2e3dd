"""The tensorclass type of the interop tests, importable by its qualified name.

tensordict carries a tensorclass through init_remote / broadcast as the string
``f"{cls.__module__}.{cls.__qualname__}"`` and the receiver imports it back
(``_resolve_tensorclass_type``: ``importlib.import_module(module).<name>``). td_peer.py
does the same, so the type travels as "td_peer_types.InteropRecord"; the C++ side registers
its tensorclass under that very name (tests/interop/interop_trees.h).
"""


class InteropRecord:
    """A stand-in for ``@tensorclass class InteropRecord: obs; action; reward``.

    Holds the inner tree (a td_peer.TD) like a tensorclass holds its ``_tensordict``.
    """

    FIELDS = ("obs", "action", "reward")

    def __init__(self, td):
        unknown = [k for k in td.items if k not in self.FIELDS]
        if unknown:
            raise KeyError(f"InteropRecord has no fields {unknown}")
        self._tensordict = td

    @classmethod
    def _from_tensordict(cls, td):
        return cls(td)
