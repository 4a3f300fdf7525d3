"""The base of every job's typed plans and results: fields with types, checked when made; the CLI
renders a model by its attributes, and ``--json`` prints :meth:`Model.doc`: the fields the job
set, under their public names (``from`` is a keyword in Python: the field is ``origin``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Model(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    def doc(self) -> dict[str, Any]:
        """The JSON document of this plan or result: what the job set, by public name."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)
