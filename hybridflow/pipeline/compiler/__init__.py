"""The step-logic compiler: the user's logic (Python or YAML) -> typed IR -> dataflow ops.
Pure: no processes, no sockets, and only `pipeline/api/` imports it (the import contract
in `make lint` says so); what runs the ops is planned by `pipeline/plan/`. Modules:
grammar (value kinds, op tables, parser), frontend (names/kinds checks: text ->
ir.StepIR), ir (the typed IR: frozen dataclasses), lowering (StepIR -> dataflow ops),
loss (the policy loss resolved: estimator, score, KL, actor/critic options). The driver
expressions it emits run in `pipeline/driver/expr.py`. Imports run one way:
frontend -> lowering -> loss -> grammar -> ir.
"""
