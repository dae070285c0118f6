"""Shared GGUF parsing while transformers converts the embedded model: the same fp32 checkpoint in about
half the time (the demo's and the tests' first minute).

transformers 5.23 parses the GGUF file three times — for the config, the weights and the tokenizer, each a
new `gguf.GGUFReader` (~8 s apiece for SmolLM2's 49,152-token vocabulary, mostly numpy memmap slicing) and
a conversion of every metadata field to Python values — and rebuilds gguf's tensor-name map once per tensor
(397 times, ~11 s in all). Inside `shared_gguf_parsing` one reader per (path, mode), one map per
(architecture, block count) and one metadata-only `load_gguf_checkpoint` result per path (handed out as a
deep copy: callers edit what they get) serve every call. All three are only read after construction, so
what is loaded is unchanged (checked: identical weights, config and vocabulary). transformers imports these
names at call time, so replacing the module attributes for the duration of the block reaches every call;
they are restored afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator


@contextlib.contextmanager
def shared_gguf_parsing() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path, mode)`, `gguf.get_tensor_name_map(arch, n)` and transformers'
    metadata-only `load_gguf_checkpoint(path)` return one shared object (a copy of it) per argument list."""
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
        with _shared_metadata():
            yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map


@contextlib.contextmanager
def _shared_metadata() -> Iterator[None]:
    """Within the block, `load_gguf_checkpoint(path, return_tensors=False)` parses each path once."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.load_gguf_checkpoint
    parsed: dict[str, dict] = {}

    def load_gguf_checkpoint(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original(path, return_tensors=return_tensors, **kwargs)
        if str(path) not in parsed:
            parsed[str(path)] = original(path, return_tensors=False)
        return copy.deepcopy(parsed[str(path)])

    gguf_utils.load_gguf_checkpoint = load_gguf_checkpoint
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = original
