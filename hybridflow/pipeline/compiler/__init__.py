"""The step-logic compiler: the user's logic (Python or YAML) -> typed IR -> dataflow ops,
and the topology -> `Plan` (which op runs where, what waits for what). Pure: no
processes, no sockets. Modules: grammar (value kinds, op tables, parser), frontend
(names/kinds checks: text -> ir.StepIR), ir (the typed IR: frozen dataclasses), lowering
(StepIR -> dataflow ops), expr (driver expressions), plan (topology -> Plan),
weight_links (which reshard feeds which load_weights). Imports run one way:
frontend -> lowering -> grammar -> ir.
"""
