"""The configuration reference: every key of a topology file and of each backend's options.

Read from the option dataclasses themselves (fields.py), from the registries (backends,
data sources, driver ops, metrics sinks) and from the one module docstring that tables
the `advantages` op's params, so none of it can drift from the code.

Produces two pages: `reference/config.md` (the topology file, section by section) and
`reference/options.md` (every role backend's `options:`, the data sources' `options:`,
the environment service client's `env_options`).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterable

from docgen.fields import FieldDoc, class_doc, field_docs
from docgen.markdown import cell, code, first_paragraph, table

# Fields whose doc is owned by code this generator may not edit, documented nowhere yet.
# tests/docs/test_docs.py keeps this list exact: a field that gains a doc must leave it.
PENDING: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Section:
    key: str  # the dotted key of the section in a topology file
    cls: type
    intro: str = ""


def topology_sections() -> list[Section]:
    from hybridflow.config import schema as s

    return [
        Section("", s.Topology),
        Section("run", s.RunConfig),
        Section(
            "data",
            s.DataConfig,
            "The source's own `options:` are in [Options](options.md#data-sources).",
        ),
        Section("stages.&lt;stage&gt;", s.StageConfig),
        Section(
            "stages.&lt;stage&gt;.roles.&lt;role&gt;",
            s.RoleConfig,
            "Each backend's `options:` are in [Options](options.md).",
        ),
        Section("dataflow[i]", s.OpConfig),
        Section(
            "liveness", s.LivenessConfig, "Every bound is on [Reliability](../reliability.md)."
        ),
        Section("transport", s.TransportConfig),
        Section("metrics", s.MetricsConfig),
        Section("metrics.options", s.TrackerOptions),
        Section("checkpoint", s.CheckpointConfig),
        Section("validation", s.ValidationConfig),
    ]


def backend_classes() -> list[tuple[str, str, str, type]]:
    """(role kind, backend, "module:Class", class) for every registered backend."""
    from hybridflow.config.imports import load_attr
    from hybridflow.stages import BACKENDS

    return [
        (kind, backend, target, load_attr(target, "docs"))
        for (kind, backend), target in sorted(BACKENDS.items())
    ]


def source_options() -> dict[str, type | None]:
    """Data source name -> its options dataclass (None: options checked by hand)."""
    from hybridflow.pipeline.sources.prompt_source import PromptSourceOptions
    from hybridflow.pipeline.sources.registry import SOURCES
    from hybridflow.pipeline.sources.sft import SFTOptions

    known: dict[str, type | None] = {"prompts": PromptSourceOptions, "sft": SFTOptions}
    return {name: known.get(name) for name in sorted(SOURCES)}


def other_option_classes() -> list[type]:
    from hybridflow.stages.env.service.client import RemoteEnvOptions

    return [RemoteEnvOptions]


def all_option_classes() -> list[type]:
    """Every option dataclass the references document (bases included via field_docs)."""
    from hybridflow.pipeline.driver.rl_ops import AdvantageParams

    classes = [sec.cls for sec in topology_sections()] + [AdvantageParams]
    classes += [c.options_cls for *_, c in backend_classes() if getattr(c, "options_cls", None)]
    classes += [c for c in source_options().values() if c is not None]
    return classes + other_option_classes()


def undocumented() -> list[str]:
    """`Class.field` of every documented class's field that has no doc."""
    seen: dict[str, FieldDoc] = {}
    for cls in all_option_classes():
        for fd in field_docs(cls):
            seen.setdefault(f"{fd.owner.__name__}.{fd.name}", fd)
    return sorted(k for k, fd in seen.items() if not fd.doc)


# -- rendering ----------------------------------------------------------------------------


def _fields_table(fields: Iterable[FieldDoc]) -> str:
    rows = []
    for fd in fields:
        doc = fd.doc or "*(no doc yet)*"
        rows.append(
            [
                code(fd.name),
                code(fd.type),
                "required" if fd.required else code(fd.default),
                cell(doc),
            ]
        )
    return table(["key", "type", "default", "meaning"], rows)


def _anchor(cls: type) -> str:
    return cls.__name__.lower()


def render_config() -> str:
    out = [
        "# Topology file reference",
        "",
        "Generated from the section dataclasses of `hybridflow/config/` (`schema.py` and the",
        "modules it imports them from; each field's doc is its comment or attribute docstring",
        "there) by `scripts/docgen`, at every `mkdocs build`.",
        "A topology file is loaded strictly: an unknown key, a wrong type or an impossible",
        "value fails before any process starts, naming the dotted key and the fix.",
        "`--set key=value` (the CLI) and `df.to_yaml()` (the Python API) speak the same keys.",
        "",
    ]
    for sec in topology_sections():
        doc = class_doc(sec.cls)
        out += [
            f"## `{sec.key}`" if sec.key else "## Top level",
            "",
            f"`{sec.cls.__name__}`" + (f": {first_paragraph(doc)}" if doc else ""),
            "",
        ]
        if sec.intro:
            out += [sec.intro, ""]
        out += [_fields_table(field_docs(sec.cls)), ""]
        if sec.key == "dataflow[i]":
            out += _driver_ops()
    return "\n".join(out)


def _driver_ops() -> list[str]:
    from hybridflow.algos.advantages import ADVANTAGE_ESTIMATORS
    from hybridflow.pipeline.driver.registry import DRIVER_OPS
    from hybridflow.pipeline.driver.rl_ops import AdvantageParams

    names = ", ".join(code(n) for n in sorted(DRIVER_OPS))
    return [
        "### Driver ops",
        "",
        f"An op of role `driver` runs in the coordinator. Registered: {names}; any other",
        "`op:` is a `package.module:attr` (see [Extending](../extending.md#a-driver-op)).",
        "The `advantages` op's `params:` (`AdvantageParams` in",
        "`hybridflow/pipeline/driver/rl_ops.py`; the estimators' options and their defaults",
        "are `hybridflow.algos.EstimatorOptions`, which a compiled step logic writes too):",
        "",
        _fields_table(field_docs(AdvantageParams)),
        "",
        "Estimators (`estimator:`; each takes the options listed):",
        "",
        table(
            ["estimator", "options", "critic values", "groups", "meaning"],
            [
                [
                    code(name),
                    ", ".join(code(o) for o in spec.options) or "none",
                    "yes" if spec.needs_values else "",
                    "yes" if spec.needs_groups else "",
                    cell(spec.doc),
                ]
                for name, spec in ADVANTAGE_ESTIMATORS.items()
            ],
        ),
        "",
    ]


def render_options() -> str:
    backends = backend_classes()
    owners = {c.options_cls: (k, b) for k, b, _, c in backends if getattr(c, "options_cls", None)}
    shared: dict[type, None] = {}
    out = [
        "# Options reference",
        "",
        "Generated from each backend's options dataclass (`options_cls`) by `scripts/docgen`.",
        "A role's `options:` block is parsed with its backend's class at plan time, so a typo",
        "fails `hybridflow validate` with its dotted key and a did-you-mean.",
        "",
        "## Role backends",
        "",
        table(
            ["role kind", "backend", "class", "options"],
            [
                [
                    code(k),
                    code(b),
                    code(t),
                    f"[{c.options_cls.__name__}](#{k.replace('*', '')}-{b})"
                    if getattr(c, "options_cls", None)
                    else "none",
                ]
                for k, b, t, c in backends
            ],
        ),
        "",
        "`*`: the `synthetic` backend plays any role (benchmarks and runtime tests).",
        "",
    ]
    for kind, backend, target, cls in backends:
        opts = getattr(cls, "options_cls", None)
        module_doc = first_paragraph(inspect.getdoc(inspect.getmodule(cls)) or "")
        out += [f"### {kind}: {backend} {{#{kind.replace('*', '')}-{backend}}}", ""]
        out += [f"`{target}`. {module_doc}", ""]
        if opts is None:
            out += ["No options.", ""]
            continue
        out += _class_fields(opts, owners, shared)
    out += _data_sources(owners, shared)
    out += ["## Environment service client (`env: remote`)", ""]
    for cls in other_option_classes():
        out += [f"`env_options` of `env: remote` (`{cls.__module__}.{cls.__name__}`):", ""]
        out += [_fields_table(field_docs(cls)), ""]
    out += ["## Shared option groups", "", "Keys several backends or sources take.", ""]
    for base in shared:
        doc = class_doc(base)
        out += [f"### {base.__name__} {{#{_anchor(base)}}}", ""]
        if doc:
            out += [first_paragraph(doc), ""]
        out += [_fields_table(fd for fd in field_docs(base) if fd.owner is base), ""]
    return "\n".join(out)


def _class_fields(
    cls: type, owners: dict[type, tuple[str, str]], shared: dict[type, None]
) -> list[str]:
    """The table of the fields `cls` declares itself, and links to the groups it extends."""
    links = []
    for base in cls.__mro__[1:]:
        if not dataclasses.is_dataclass(base) or not any(
            fd.owner is base for fd in field_docs(base)
        ):
            continue
        if base in owners:
            k, b = owners[base]
            links.append(f"[{base.__name__}](#{k.replace('*', '')}-{b})")
        else:
            shared.setdefault(base)
            links.append(f"[{base.__name__}](#{_anchor(base)})")
    out = [f"`{cls.__name__}`" + (f"; also every key of {', '.join(links)}." if links else "."), ""]
    own = [fd for fd in field_docs(cls) if fd.owner is cls]
    if own:
        out += [_fields_table(own), ""]
    return out


def _data_sources(owners: dict[type, tuple[str, str]], shared: dict[type, None]) -> list[str]:
    from hybridflow.config.imports import load_attr
    from hybridflow.pipeline.sources.registry import SOURCES

    out = ["## Data sources", "", "`data.source` names one; `data.options` are its options.", ""]
    for name, opts in source_options().items():
        cls = load_attr(SOURCES[name], "docs")
        doc = class_doc(cls) or inspect.getdoc(inspect.getmodule(cls))
        out += [f"### {name}", "", f"`{SOURCES[name]}`. {first_paragraph(doc or '')}", ""]
        fields = getattr(cls, "FIELDS", ())
        if fields:
            out += [f"Fields it can provide: {', '.join(code(f) for f in fields)}.", ""]
        if name == "prompts":
            out += [
                "Options: `samples_per_prompt` (int, default 1: every prompt repeated on that",
                "many consecutive rows, one GRPO group) and the keys below.",
                "",
            ]
        if opts is not None:
            out += _class_fields(opts, owners, shared)
        elif cls.__doc__:
            match = re.search(r"Options: (.*)", cls.__doc__)
            if match:
                out += [f"Options: {match.group(1)}", ""]
    return out
