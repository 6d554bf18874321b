"""Write, or check, the configuration reference: the JSON Schemas of run configs and
sweep files, and docs/configuration.md's tables, all generated from the config
dataclasses (`pipeline.config.reference` does the generating).

    python -m experiments.sweep.reference --write    # regenerate all three
    python -m experiments.sweep.reference            # exit 1 naming what is stale

Why here and not in `pipeline.config`: a sweep file's schema belongs to
`experiments`, and only this layer sees both it and the run config's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from experiments.scaling.config import ScalingPoint, ScalingSweepConfig
from experiments.sweep.config import SweepConfig
from pipeline.config.reference import (json_schema, markdown_table, replace_generated, rows,
                                       schema_text, undocumented)
from pipeline.config.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
RUN_SCHEMA = ROOT / "configs" / "run.schema.json"
SWEEP_SCHEMA = ROOT / "configs" / "sweep.schema.json"
PAGE = ROOT / "docs" / "configuration.md"
#: Every config class the reference documents, each field of which needs a meaning.
DOCUMENTED = (RunConfig, SweepConfig, ScalingSweepConfig, ScalingPoint)


def run_schema() -> dict:
    """The JSON Schema of a run config file (configs/*.yaml)."""
    return json_schema(RunConfig, "hetcnn run config")


def sweep_schema() -> dict:
    """The JSON Schema of a sweep file: a scaling sweep's where `mode: scaling`, else a
    measured (or predicted) sweep's."""
    schema = json_schema(SweepConfig, "hetcnn sweep file")
    scaling = json_schema(ScalingSweepConfig, "hetcnn scaling sweep file")
    definitions = {**schema.pop("definitions"), **scaling.pop("definitions")}
    return {"$schema": schema["$schema"], "title": schema["title"],
            "if": {"properties": {"mode": {"const": "scaling"}}, "required": ["mode"]},
            "then": {"$ref": scaling["$ref"]}, "else": {"$ref": schema["$ref"]},
            "definitions": dict(sorted(definitions.items()))}


def page_text(text: str) -> str:
    """docs/configuration.md with its generated tables brought up to date."""
    for section, cls, prefix in (("run", RunConfig, ""), ("sweep", SweepConfig, ""),
                                 ("scaling", ScalingSweepConfig, ""),
                                 ("scaling-point", ScalingPoint, "base.")):
        text = replace_generated(text, section, markdown_table(rows(cls, prefix)))
    return text


def expected() -> dict[Path, str]:
    """Each generated file's text as the code says it should be."""
    return {RUN_SCHEMA: schema_text(run_schema()), SWEEP_SCHEMA: schema_text(sweep_schema()),
            PAGE: page_text(PAGE.read_text(encoding="utf-8"))}


def stale() -> list[Path]:
    """The generated files that differ from what the code makes (missing counts)."""
    return [path for path, text in expected().items()
            if not path.exists() or path.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.sweep.reference",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="regenerate the schemas and docs/configuration.md's tables")
    args = parser.parse_args(argv)
    missing = [name for cls in DOCUMENTED for name in undocumented(cls)]
    if missing:
        print(f"error: fields without a meaning: {', '.join(missing)}", file=sys.stderr)
        return 1
    if args.write:
        for path, text in expected().items():
            path.write_text(text, encoding="utf-8")
        return 0
    old = stale()
    if old:
        names = ", ".join(os.path.relpath(path, ROOT) for path in old)
        print(f"error: stale: {names}; run "
              "python -m experiments.sweep.reference --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
