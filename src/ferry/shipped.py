"""ferry running from the zip its driver shipped to a Spark executor (:mod:`ferry.spark.ship`).

An executor's Python finds the zip on its path and imports ``ferry`` from it; this module, which
needs nothing but the standard library, unpacks the zip (binary modules such as pydantic_core
cannot load from a zip) and puts the unpacked copy ahead of the zip on the path. It unpacks once
per machine and zip, whose name carries the digest of its content, into a folder of this user's
(``$TMPDIR/ferry-<uid>/``, mode 0700): the compiled bytecode Python writes there serves every later
worker, application and Spark Connect session. Where that folder is not this user's alone, the
zip is unpacked beside itself, in the executor's own folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
import tempfile
import zipfile

__all__ = ["unpacked"]


def unpacked(init_file: str) -> str:
    """Unpack the zip holding `init_file` (ferry/__init__.py inside it) and return the unpacked
    ``ferry`` package's folder. Several Python workers of one executor may race: each unpacks into
    its own folder and one rename wins."""
    zip_path = init_file[: init_file.index(".zip") + len(".zip")]
    mine = _private(os.path.join(tempfile.gettempdir(), f"ferry-{os.getuid()}"))
    root = _unpack(zip_path, os.path.join(mine, os.path.basename(zip_path))) if mine else None
    if root is None:
        root = _unpack(zip_path, zip_path + ".d")
    if root is None:
        raise ImportError(f"ferry: could not unpack {zip_path} on this Spark executor")
    if root not in sys.path:
        at = sys.path.index(zip_path) if zip_path in sys.path else 1
        sys.path.insert(at, root)
    return os.path.join(root, "ferry")


def _private(folder: str) -> str | None:
    """`folder`, made if missing, when it is this user's and nobody else may write in it."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.stat(folder, follow_symlinks=False)
    except OSError:
        return None
    return folder if st.st_uid == os.getuid() and not st.st_mode & 0o022 and stat.S_ISDIR(st.st_mode) else None


def _unpack(zip_path: str, root: str) -> str | None:
    if os.path.isdir(root):
        return root
    tmp = f"{root}.{os.getpid()}.tmp"
    try:
        with zipfile.ZipFile(zip_path) as z:
            z.extractall(tmp)
        os.rename(tmp, root)
    except OSError:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        return root if os.path.isdir(root) else None  # another worker renamed first
    return root
