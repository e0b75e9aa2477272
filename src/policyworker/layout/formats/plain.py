"""`PlainFormat`: every byte lands as it was sent (the default format of a plan).

It converts no copy, so the generic code moves every byte itself; the methods that
only converted copies reach are never called and say so if they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from policyworker.errors import PlanError
from policyworker.layout.formats.base import PullLaunch

__all__ = ["PlainFormat"]


class PlainFormat(msgspec.Struct, frozen=True, tag="plain", tag_field="name"):
    """Destination tensors hold the parameters' bytes, in the parameters' dtype."""

    passthrough: ClassVar[bool] = True
    compressible: ClassVar[bool] = True

    def converted_tensors(self, layout: Any) -> frozenset[tuple[int, str]]:
        return frozenset()

    def box_nbytes(self, start: Sequence[int], stop: Sequence[int], param_dtype: str) -> int:
        raise self._never("box_nbytes")

    def dest_dtype(self, local_dtype: str, param_dtype: str) -> str:
        return param_dtype

    def converts(self, plan: Any, copy: Any) -> bool:
        return False

    def split_copy(self, plan: Any, copy: Any, max_bytes: int) -> list[Any]:
        raise self._never("split_copy")

    def pack_copy(self, plan: Any, copy: Any, local_tensors: Any, out: Any, offset: int) -> int:
        raise self._never("pack_copy")

    def unpack_copy(self, plan: Any, copy: Any, buf: Any, local_tensors: Any, offset: int) -> int:
        raise self._never("unpack_copy")

    def extra_tensors(self, plan: Any, rank: int, device: Any) -> dict[str, Any]:
        return {}

    def extra_bytes(self, plan: Any) -> int:
        return 0

    def converts_tensor(self, plan: Any, local: Any) -> bool:
        return False

    def reference_local(self, plan: Any, rank: int, name: str, high: Any) -> dict[str, Any]:
        raise self._never("reference_local")

    def pull_job(self, plan: Any, copy: Any, src_local: Any, dst_tensors: Any) -> Any:
        raise self._never("pull_job")

    def pull_launch(self, plan: Any, jobs: Sequence[Any], copies: Sequence[tuple[Any, Any]]) -> PullLaunch:
        return PullLaunch(copies)

    @staticmethod
    def _never(method: str) -> PlanError:
        return PlanError(f"the plain format converts no copy; {method} was called for one")
