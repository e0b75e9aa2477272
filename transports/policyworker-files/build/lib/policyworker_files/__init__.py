"""policyworker-files: a policyworker transport that refits through a shared directory.

One directory per version, safetensors files, a checksummed manifest, and the atomic
rename of a temporary directory as the commit point; old versions are pruned. Useful
where the trainer and the engines share only a filesystem. Registered under the
entry-point group ``policyworker.transports`` as ``files``::

    await trainer.attach_transport("files", directory="/shared/refit", keep=2)
    await rollout.attach_transport("files", directory="/shared/refit")
    await trainer.refit("files")          # writes v1
    await rollout.refit("files", refit_timeout_s=60)   # lands v1 (or the newest)
"""

from __future__ import annotations

from .manifest import FileEntry, Manifest, ParamSpec, Signature, TensorEntry
from .transport import FilesSetup, FilesTransport

__all__ = ["FileEntry", "FilesSetup", "FilesTransport", "Manifest", "ParamSpec", "Signature", "TensorEntry"]
__version__ = "0.1.0"
