#!/usr/bin/env python3
"""Writes the Megatron indexed-dataset golden files in tests/data/megatron/ with Megatron-Core's
own writer (megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder), so that dstrain's
reader is checked against the reference tool's bytes, not against dstrain's own writer.

Developer-side only (CI reads the shipped files, never runs this). Needs numpy and the
megatron-core wheel unpacked somewhere (its indexed_dataset module needs only numpy to write;
PyTorch, which the package imports, is stood in for by empty modules here):

    pip download megatron-core --no-deps -d /tmp/mc && python3 -m zipfile -e /tmp/mc/*.whl /tmp/mc/ext
    pip install numpy
    python3 tools/make_megatron_golden.py /tmp/mc/ext

The corpus: the first 3,000 bytes of data/tinyshakespeare.txt as byte ids, cut into three
documents at bytes 1,000 and 2,200, each followed by an end-of-document id 0; the second
document is written as two sequences (Megatron's add_document with two lengths). One dataset per
integer element type Megatron writes; expected_ids.txt holds the ids every one must yield;
documents_uint16 holds the same documents one sequence each (what dstrain's writer must match).
"""
import importlib.abc
import importlib.machinery
import os
import sys
import types
from unittest import mock


def stand_in_for_torch(megatron_root):
    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name == "torch" or name.startswith("torch."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            module = mock.MagicMock(name=spec.name)
            module.__path__ = []
            module.__spec__ = spec
            return module

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Finder())
    # The package __init__ files import the whole framework: only the dataset module is loaded.
    for name, sub in [("megatron", "megatron"), ("megatron.core", "megatron/core"),
                      ("megatron.core.datasets", "megatron/core/datasets")]:
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(megatron_root, sub)]
        sys.modules[name] = package
    for name in ["megatron.core.utils", "megatron.core.msc_utils"]:
        sys.modules[name] = mock.MagicMock(name=name)
    # Plain local files (no multi-storage client).
    sys.modules["megatron.core.msc_utils"].MultiStorageClientFeature.is_enabled.return_value = False


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    stand_in_for_torch(sys.argv[1])
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    with open(os.path.join(repo, "data", "tinyshakespeare.txt"), "rb") as f:
        text = f.read(3000)
    cuts = [0, 1000, 2200, 3000]
    documents = [list(text[a:b]) + [0] for a, b in zip(cuts, cuts[1:])]
    out_dir = os.path.join(repo, "tests", "data", "megatron")
    os.makedirs(out_dir, exist_ok=True)

    class Tensor:  # what add_item reads of a torch tensor
        def __init__(self, values):
            self.values = numpy.array(values)

        def numpy(self):
            return self.values

    for dtype in [numpy.uint16, numpy.int32, numpy.uint8, numpy.int8, numpy.int16, numpy.int64]:
        prefix = os.path.join(out_dir, "shakespeare_" + numpy.dtype(dtype).name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for i, doc in enumerate(documents):
            if i == 1:  # two sequences in one document
                builder.add_document(numpy.array(doc), [400, len(doc) - 400])
            else:
                builder.add_item(Tensor(doc))
                builder.end_document()
        builder.finalize(prefix + ".idx")
    # One sequence per document, uint16: what dstrain-prep --output-format megatron writes for
    # these documents, byte for byte.
    builder = IndexedDatasetBuilder(os.path.join(out_dir, "documents_uint16.bin"), dtype=numpy.uint16)
    for doc in documents:
        builder.add_item(Tensor(doc))
        builder.end_document()
    builder.finalize(os.path.join(out_dir, "documents_uint16.idx"))
    with open(os.path.join(out_dir, "expected_ids.txt"), "w") as f:
        f.write(" ".join(str(t) for doc in documents for t in doc) + "\n")


if __name__ == "__main__":
    main()
