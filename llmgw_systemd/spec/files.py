"""Spec files and folders on disk -> parsed documents (the reading shell)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from llmgw_systemd.errors import SpecError
from llmgw_systemd.spec.document import Document, parse
from llmgw_systemd.spec.names import is_spec_file


def spec_files(paths: Sequence[str]) -> list[str]:
    """Each path as given, a folder expanded to its *.yaml/*.yml files in name order."""
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(n for n in os.listdir(path)
                           if is_spec_file(n))
            if not found:
                raise SpecError(path, None, "", "the folder holds no *.yaml spec file")
            files.extend(os.path.join(path, n) for n in found)
        else:
            files.append(path)
    return files


def read_each(paths: Sequence[str]) -> list[Document | SpecError]:
    """Every spec file, each parsed on its own: a file that cannot be read or parsed
    comes back as its error (spec.collect_spec's input)."""
    out: list[Document | SpecError] = []
    for file in spec_files(paths):
        try:
            out.extend(read_documents([file]))
        except SpecError as exc:
            out.append(exc)
    return out


def read_documents(paths: Sequence[str]) -> list[Document]:
    docs = []
    for file in spec_files(paths):
        name = os.path.abspath(file)
        try:
            with open(file, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise SpecError(file, None, "", "no such file") from None
        except OSError as exc:
            raise SpecError(file, None, "", f"cannot read: {exc.strerror}") from None
        docs.append(parse(raw, name))
    return docs
