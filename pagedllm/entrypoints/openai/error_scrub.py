"""Error text for clients without the server's internals: file paths and socket addresses.

An engine failure's message can quote a library's source location or a peer's address (gloo:
``[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer
[10.0.0.2]:29500``). Every error body the server sends goes through ``scrub``; the server log keeps
the full text. A URL the client sent (``https://...``) is left as it is.
"""

from __future__ import annotations

import re

_ROOTS = ("home", "tmp", "usr", "opt", "root", "work", "var", "pytorch", "project", "proc", "dev", "mnt",
          "data", "srv", "etc", "lib", "lib64", "run", "nix", "private", "Users", "build", "workspace", "app")
_EXT = r"(?:py|pyc|pyx|cc|cpp|cxx|c|h|hpp|cu|cuh|so|dylib|json|safetensors|gguf|bin|pt|txt|log|sock)"
_SEGMENT = r"/[\w.@+~-]+"
# an absolute path under a system root, or any path of two segments or more naming a source/data file
_PATH = re.compile(rf"(?<![\w:/.])(?:[A-Za-z]:)?(?:/(?:{'|'.join(_ROOTS)})(?:{_SEGMENT})+/?"
                   rf"|(?:{_SEGMENT}){{2,}}\.{_EXT}\b)(?::\d+)?")
_ADDRESS = re.compile(r"\[[0-9A-Fa-f:.]*[:.][0-9A-Fa-f:.]*\](?::\d+)?"  # [10.0.0.2]:29500, [::1]:80
                      r"|(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?(?![\w.])"  # 10.0.0.2:29500
                      r"|\blocalhost:\d+\b")


def scrub(message: str) -> str:
    """``message`` with file paths replaced by ``<path>`` and socket addresses by ``<address>``."""
    if not message:
        return message
    return _ADDRESS.sub("<address>", _PATH.sub("<path>", message))
