"""The topology -> `Plan`: which op runs on which process, what waits for what within a
step, and which reshard feeds which `load_weights` (weight_links). Pure: no processes, no
sockets. The runtime, the launchers and every stage host read a `Plan`; none of them needs
the step-logic compiler (pipeline/compiler/, imported by pipeline/api/ only).
"""
