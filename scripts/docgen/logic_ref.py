"""The step-logic reference, from the grammar's tables (pipeline/compiler/grammar.py).

Every name the language knows is in one of those tables: value kinds, input names, role
names, role methods, algorithm functions, and the constructs the parser refuses. This page
is those tables laid out; a new method or function in the grammar appears here by itself.
"""

from __future__ import annotations

from docgen.markdown import cell, code, table

# The page's example (tests/docs/test_docs.py compiles it).
EXAMPLE = """
response = actor.generate(prompt, n=8)
reward_score = reward.score(prompt, response)
ref_logprob = ref.get_logprob(prompt, response)
actor_logprob = actor.get_logprob(prompt, response)
kl_div = kl(actor_logprob, ref_logprob)
loss = grpo_loss(reward_score, kl_div, kl_loss_coef=0.05)
actor.update(loss)
"""


def _kinds(options: tuple[tuple[str, ...], ...]) -> str:
    return "<br>".join("(" + ", ".join(arg) + ")" for arg in options)


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(code(n) for n in names) if names else "none"


def render_logic() -> str:
    from hybridflow.pipeline.compiler import grammar
    from hybridflow.pipeline.driver import expr

    logic_roles: dict[str, list[str]] = {}
    for logic_name, runtime in grammar.ROLES.items():
        logic_roles.setdefault(runtime, []).append(logic_name)
    out = [
        "# Step-logic language reference",
        "",
        "`define_training_step(inputs, outputs, logic)` takes the step as Python-like text. It",
        "is parsed with Python's `ast` and **never executed**: the compiler turns each line into",
        "dataflow ops, the same ops a YAML topology lists. Generated from the tables in",
        "`hybridflow/pipeline/compiler/grammar.py` by `scripts/docgen`.",
        "",
        "```python",
        'df.define_training_step(inputs=["prompt"], outputs=["loss", "rewards"], logic="""',
        EXAMPLE.strip("\n"),
        '""")',
        "```",
        "",
        "## Statements",
        "",
        "One statement per line, each of one of these forms:",
        "",
        "- `name = role.method(value, ..., option=constant)`: a role call;",
        "- `name = function(value, ..., option=constant)`: an algorithm function;",
        "- `name = arithmetic`: value names and numbers with "
        + ", ".join(f"`{s}`" for s in expr.SYMBOLS.values())
        + f", unary minus and parentheses, at most {expr.MAX_DEPTH} levels deep;",
        "- `role.update(loss)`: a bare update call (it produces no value).",
        "",
        "Every name is assigned once. Arguments are value names; options are constants",
        "(numbers, strings, `True`/`False`/`None`). A string on a line of its own is a comment;",
        "`pass` is allowed. Names starting with `__` are refused.",
        "",
        "## Inputs",
        "",
        "Names `inputs=[...]` may use: "
        + ", ".join(f"{code(k)} (a {code(v)})" for k, v in grammar.INPUTS.items())
        + ". The runtime reads them from the data fields "
        + ", ".join(code(f) for f in grammar.DATA_FIELDS)
        + ".",
        "",
        "## Values",
        "",
        "Every value has a kind; a method or function accepts certain kinds. A declared",
        "output of a kind with a metric is reported per step by that metric.",
        "",
        table(
            ["kind", "stands for (runtime fields)", "reported as", "meaning"],
            [
                [code(name), _names(k.fields), code(k.metric) if k.metric else "", cell(k.doc)]
                for name, k in grammar.KINDS.items()
            ],
        ),
        "",
        "## Roles",
        "",
        table(
            ["in the logic", "topology role"],
            [[", ".join(code(n) for n in names), code(rt)] for rt, names in logic_roles.items()],
        ),
        "",
        "## Role methods",
        "",
        table(
            ["call", "runs op", "arguments (kinds)", "result", "options"],
            [
                [
                    code(f"{logic_roles[role][0]}.{method}"),
                    code(f"{m.runtime_role}.{m.op}"),
                    _kinds(m.args),
                    code(m.result) if m.result else "(an update)",
                    _names(m.options),
                ]
                for (role, method), m in grammar.ROLE_METHODS.items()
            ],
        ),
        "",
        "## Algorithm functions",
        "",
        table(
            ["function", "arguments (kinds)", "result", "options", "older spellings", "meaning"],
            [
                [
                    code(name),
                    _kinds(a.args),
                    code(a.result),
                    _names(a.options),
                    "<br>".join(f"{code(old)} = {code(new)}" for old, new in a.aliases.items()),
                    cell(a.doc),
                ]
                for name, a in grammar.ALGORITHMS.items()
            ],
        ),
        "",
        "An option is named after the option it sets. Options of `ppo_loss` / `grpo_loss`",
        "that configure the update are the actor's options of the same names ("
        + ", ".join(code(o) for o in grammar.ACTOR_LOSS_OPTIONS)
        + ");",
        "`grpo_loss`'s KL term is the actor's `kl_loss_coef` / `kl_loss_type`, `ppo_loss`'s KL",
        "penalty in the reward the `advantages` op's `kl_coef` / `kl_penalty` (a KL option",
        "must agree with the KL argument's `kind`); estimator and shaping options become the",
        "`advantages` op's params (see the [topology reference](config.md#driver-ops)). The",
        "older spellings still compile to the same plan; giving both spellings is an error.",
        "",
        "## Refused constructs",
        "",
        "Anything else is a `CompileError` naming the line and the reason:",
        "",
        table(
            ["construct", "reason"],
            [
                [code(node.__name__), cell(reason)]
                for node, reason in sorted(grammar._REJECT.items(), key=lambda kv: kv[0].__name__)
            ],
        ),
        "",
    ]
    return "\n".join(out)
