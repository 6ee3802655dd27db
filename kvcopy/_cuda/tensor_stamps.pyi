"""Type stub of kvcopy._cuda.tensor_stamps: the identity, version and address check of
kept torch tensors."""

from typing import Any, Sequence

def identity_hash(tensors: Sequence[Any]) -> int: ...
def stamps_hold(refs: tuple, tensors: Sequence[Any], versions: tuple, addresses: tuple) -> bool: ...
