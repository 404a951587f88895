"""The step-logic compiler: the user's logic (Python or YAML) -> typed IR -> dataflow ops,
and the topology -> `Plan` (which op runs where, what waits for what). Pure: no
processes, no sockets. Modules: grammar (value kinds, op tables, parser), frontend
(names/kinds checks), lowering (IR -> dataflow ops), expr (driver expressions), plan
(topology -> Plan), weight_links (which reshard feeds which load_weights).
"""
