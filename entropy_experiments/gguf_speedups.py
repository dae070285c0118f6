"""Shared GGUF parsing while transformers converts the embedded model: the same fp32 checkpoint in about
half the time (issue 16: the demo's and the tests' first minute).

transformers 5.23 parses the GGUF file three times — for the config, the weights and the tokenizer, each a
new `gguf.GGUFReader` (~8 s apiece for SmolLM2's 49,152-token vocabulary, mostly numpy memmap slicing) —
and rebuilds gguf's tensor-name map once per tensor (397 times, ~11 s in all). Inside `shared_gguf_parsing`
one reader per (path, mode) and one map per (architecture, block count) serve every call: both are only
read after construction, so what is loaded is unchanged (tests/test_model_loader.py converts with and
without and compares). transformers imports both names from `gguf` at call time, so replacing the
module's attributes for the duration of the block reaches every call; they are restored afterwards.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator


@contextlib.contextmanager
def shared_gguf_parsing() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path, mode)` and `gguf.get_tensor_name_map(arch, n)` return one
    shared object per distinct argument list."""
    import gguf

    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(original_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map
